"""Plain vLLM against transformers, no kvdiag: does the installed vLLM compute the checkpoint's function? One recall
prompt (the first ``kv_recall`` document), greedy, 8 tokens, bf16, eager, the engine core in this process; and the
log-probabilities of the first generated position, vLLM's top 20 against transformers' at the same ids. vLLM's
memory sized as kvdiag sizes it (tests/support/probes.py ``sized``: an explicit 64 MiB KV cache).
``python3 tests/support/vllm_reference_probe.py MODEL`` -> ``PROBE {json}`` on stdout (docs/vllm-findings.md 13)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
TASK = Path(__file__).resolve().parents[2] / "kvdiag" / "tasks" / "data" / "kv_recall.jsonl"


def main(model: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompt = json.loads(TASK.read_text().splitlines()[0])["context"]
    ids = AutoTokenizer.from_pretrained(model)(prompt)["input_ids"]
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16)
    with torch.no_grad():
        hf_tokens = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids):].tolist()
        hf_lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0, -1].float(), -1)
    from probes import sized
    from vllm import LLM, SamplingParams

    llm = LLM(**sized(dict(model=model, enforce_eager=True, max_model_len=2048, dtype="bfloat16", seed=0)))
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=8, temperature=0.0, logprobs=20),
                       use_tqdm=False)[0].outputs[0]
    first = out.logprobs[0]
    diff = max(abs(lp.logprob - hf_lp[t].item()) for t, lp in first.items())
    return {"prompt_tokens": len(ids), "transformers": hf_tokens, "vllm": list(out.token_ids),
            "first_top20_max_abs_dlogprob": round(diff, 4)}


if __name__ == "__main__":
    print("PROBE " + json.dumps(main(sys.argv[1])), flush=True)
    os._exit(0)
