"""Plain vLLM, no kvdiag engine and no lm_eval: the conversation tasks (kv_decode, kv_multiturn) run turn by turn
as a chat is served, the oracle of kvdiag's turn runner (kvdiag/checks/accuracy/harness/conversation.py). Every
conversation's
turn k goes in one ``generate`` call: its prompt is turn k-1's prompt, vLLM's own answer to it and turn k's text;
the prefix cache (on) serves the earlier turns. Scored with the tasks' own ``kv_turns.process_*``; one line
``PROBE {json}``: per task, the score and each document's right or wrong.

    python3 tests/support/vllm_turns_probe.py [--task kv_decode] [--task kv_multiturn] [--kv-dtype D] [--limit N]
        [--model M] [-a key=value ...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # kvdiag's task files, from this checkout


def generation(task: str) -> tuple[list[str], int]:
    """The task YAML's stop strings and tokens a turn (its ``!function`` tags are not needed here)."""
    import yaml

    from kvdiag.tasks import TASKS_DIR

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_constructor("!function", lambda loader, node: None)
    g = yaml.load((TASKS_DIR / f"{task}.yaml").read_text(), Loader=Loader)["generation_kwargs"]
    return list(g["until"]), int(g["max_gen_toks"])


def run_task(llm, task: str, limit: int | None) -> dict:
    from vllm import SamplingParams

    from kvdiag.tasks import TASKS_DIR, kv_turns

    docs = [json.loads(x) for x in (TASKS_DIR / "data" / f"{task}.jsonl").read_text().splitlines()][:limit]
    until, max_tokens = generation(task)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop=until)
    turns = [d["context"].split(kv_turns.TURN) for d in docs]
    text, answers = [t[0] for t in turns], [[] for _ in docs]
    for k in range(max(len(t) for t in turns)):
        live = [i for i in range(len(docs)) if k < len(turns[i])]
        for i in live:
            if k:
                text[i] += answers[i][-1] + turns[i][k]
        outs = llm.generate([text[i] for i in live], params, use_tqdm=False)
        for i, o in zip(live, outs):
            answers[i].append(o.outputs[0].text)
    score = getattr(kv_turns, "process_decode" if task == "kv_decode" else "process_turns")
    rows = [score(d, [kv_turns.TURN.join(a)]) for d, a in zip(docs, answers)]
    right = [r["exact_match"] for r in rows]
    return {"n": len(docs), "exact_match": sum(right) / len(right), "right": right}


def _arg(kv: str) -> tuple:
    """``key=value``, the value as JSON where it is (``true``, ``256``), else the string."""
    key, _, value = kv.partition("=")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--task", action="append", choices=("kv_decode", "kv_multiturn"))
    ap.add_argument("--kv-dtype", default="auto")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--model", default=None, help="default: kvdiag's shipped tiny model")
    ap.add_argument("-a", dest="engine_args", action="append", default=[], help="vLLM engine argument key=value")
    a = ap.parse_args()
    from vllm import LLM

    from kvdiag.assets import TINY_MODEL
    from kvdiag.models import resolve

    extra = dict(_arg(kv) for kv in a.engine_args)
    llm = LLM(model=resolve(a.model or str(TINY_MODEL)), kv_cache_dtype=a.kv_dtype, seed=0, max_model_len=2048,
              enable_prefix_caching=True, **extra)
    res = {"kv_dtype": a.kv_dtype, "tasks": {t: run_task(llm, t, a.limit) for t in a.task or ["kv_decode",
                                                                                            "kv_multiturn"]}}
    print("PROBE " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)  # skip vLLM's atexit teardown
