"""Engine row of `kvdiag bench`: builtin engine decode tokens/s against transformers ``generate``.

Both run the same random-weight Qwen2 checkpoint of ~0.5B shape (kvdiag.models.gen.QWEN2_05B)
in bf16 on the same device, greedy, with the same random prompts, EOS ignored. Decode
tokens/s = batch x (N - 1) / (time to generate N tokens - time to generate 1), so the
prompt's prefill cancels out.
"""

from __future__ import annotations

import tempfile
import time

import torch

PROMPT_LEN, NEW_TOKENS = 64, 128


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn) -> float:
    _sync()
    t = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - t


def decode_tps(generate, batch: int, new_tokens: int, repeats: int = 3) -> tuple[float, dict]:
    """Decode tokens/s of ``generate(n)`` (which produces n tokens for each of ``batch`` prompts): the fastest
    of ``repeats`` runs of each length, since both engines are bound by host time, which other processes
    on the machine disturb (BENCHMARKS.md, "Engine": raw seconds of such runs). Also returns the raw seconds."""
    generate(4)  # warm-up: kernels compiled, allocator primed
    firsts = [_timed(lambda: generate(1)) for _ in range(max(2, repeats))]
    fulls = [_timed(lambda: generate(new_tokens)) for _ in range(repeats)]
    runs = {"generate_1_s": firsts, f"generate_{new_tokens}_s": fulls}
    return batch * (new_tokens - 1) / max(min(fulls) - min(firsts), 1e-9), runs


def _builtin(path, device, prompts, new_tokens, repeats):
    from kvdiag.engines.base import EngineSpec
    from kvdiag.engines.builtin.engine import BuiltinEngine
    from kvdiag.kernels import dispatch

    e = BuiltinEngine()
    blocks = len(prompts) * -(-(PROMPT_LEN + new_tokens + 8) // 16) + 16
    e.start(EngineSpec(model=str(path), device=str(device), dtype="bfloat16", max_model_len=PROMPT_LEN + new_tokens + 8,
                       num_blocks=blocks, max_num_seqs=len(prompts), engine_args={"ignore_eos": True}))
    try:
        tps, runs = decode_tps(lambda n: e.generate(prompts, n), len(prompts), new_tokens, repeats)
        return tps, runs, dispatch.backend("paged_attention", torch.device(device))
    finally:
        e.shutdown()


def _transformers(path, device, prompts, new_tokens, repeats):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device).eval()
    ids = torch.tensor(prompts, device=device)
    mask = torch.ones_like(ids)

    def generate(n):
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,  # noqa: F821
                           pad_token_id=model.config.pad_token_id)  # noqa: F821

    try:
        return decode_tps(generate, len(prompts), new_tokens, repeats)
    finally:
        del model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


TINY = dict(arch="qwen2", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)


def engine_rows(device, batch_sizes=(1, 32), new_tokens: int = NEW_TOKENS, tiny: bool = False) -> list[dict]:
    """``tiny``: a 2-layer model instead of the ~0.5B one (CPU tests of this code)."""
    from kvdiag.models.gen import QWEN2_05B, make_random_model

    cfg = dict(TINY if tiny else QWEN2_05B)
    arch = cfg.pop("arch")
    cfg["dtype"] = "bfloat16"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = make_random_model(tmp, arch, **cfg)
        gen = torch.Generator().manual_seed(0)
        for batch in batch_sizes:
            prompts = torch.randint(3, 259, (batch, PROMPT_LEN), generator=gen).tolist()
            repeats = 1 if tiny else 3
            ours, ours_runs, backend = _builtin(path, device, prompts, new_tokens, repeats)
            hf, hf_runs = _transformers(path, device, prompts, new_tokens, repeats)
            rows.append({"kernel": "engine", "model": f"random {arch} {'tiny' if tiny else '~0.5B shape'}, bf16",
                         "batch": batch,
                         "prompt_len": PROMPT_LEN, "new_tokens": new_tokens, "builtin_tok_s": ours,
                         "transformers_tok_s": hf, "speedup": ours / hf, "builtin_kernels": backend,
                         "repeats": repeats,
                         "runs": {"builtin": ours_runs, "transformers": hf_runs}})
    return rows
