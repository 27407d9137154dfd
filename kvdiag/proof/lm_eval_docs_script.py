#!/usr/bin/env python3
"""A score regression kvdiag's accuracy check found, shown with lm_eval and vLLM alone.

The documents whose score changed between the baseline kv dtype and the dtype (by doc id within the task, listed
below with the scores kvdiag saw) are scored again by lm_eval's own vLLM backend, once per dtype, each in a fresh
process with every engine argument and environment variable kvdiag gave that dtype's engine and the lm_eval settings
of the run. The regression reproduces when the dtype again loses, over these documents, at least half of what it lost
in kvdiag's run.

    python3 THIS_FILE            # exit 1: the regression reproduces; 0: it does not; 2: an engine did not run
    python3 THIS_FILE --run 0    # the baseline dtype's scores alone, as JSON (--run 1: the dtype's)

Needs lm_eval and vLLM (and its torch). A task scored by loglikelihood (multiple choice) has its documents inline:
``CASE["requests"]``, each document's (context, continuation) pairs as lm_eval made them (few-shot examples and chat
template applied), its gold choice and its choices' lengths; they are scored by lm_eval's vLLM backend, without the
task or its dataset. Otherwise the documents come from the task's own dataset (a task shipped with kvdiag is read
from the task folder named in CASE). CASE is what kvdiag recorded; edit it to try another configuration.
"""

import json
import os
import subprocess
import sys

CASE: dict = {}  # filled in by kvdiag: the task, its documents and scores, the two engines, lm_eval's settings
MARK = "@@reproducer-output "


def score_inline(engine: dict) -> dict:
    """{doc id: the metric's value} of the documents from their requests below (no task, no dataset): each
    (context, continuation)'s loglikelihood from lm_eval's vLLM backend, the metric as lm_eval's task computes it
    (multiple choice: the choice of highest loglikelihood, per character for acc_norm, against the gold one)."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.vllm_causallms import VLLM

    lm = VLLM(pretrained=engine["llm"]["model"], **{k: v for k, v in engine["llm"].items() if k != "model"})
    reqs, owner = [], []
    for doc, r in CASE["requests"].items():
        for pair in r["arguments"]:
            reqs.append(Instance("loglikelihood", {}, tuple(pair), len(reqs), (CASE["task"], int(doc), 1)))
            owner.append(doc)
    got = lm.loglikelihood(reqs)
    name, out = CASE["metric"].partition(",")[0], {}
    for doc, r in CASE["requests"].items():
        lls = [ll for (ll, _), o in zip(got, owner) if o == doc]
        if r["type"] == "loglikelihood":  # one continuation: is it the greedy one
            out[doc] = float(next(g for (_, g), o in zip(got, owner) if o == doc))
            continue
        per = [ll / n if name == "acc_norm" and n else ll for ll, n in zip(lls, r["chars"])]
        pred = max(range(len(per)), key=per.__getitem__)
        out[doc] = float(pred in r["gold"] if isinstance(r["gold"], list) else pred == r["gold"])
    return out


def score(index: int) -> dict:
    """{doc id: the metric's value} of the documents, scored by lm_eval with engine ``index``'s vLLM."""
    engine = CASE["engines"][index]
    os.environ.update(engine["env"])
    if CASE.get("requests"):
        return score_inline(engine)
    import lm_eval
    from lm_eval.tasks import TaskManager

    args = {k: v for k, v in engine["llm"].items() if k != "model"}
    tm = TaskManager(include_path=CASE["include_path"] or None, include_defaults=CASE["include_defaults"])
    res = lm_eval.simple_evaluate(model="vllm", model_args={"pretrained": engine["llm"]["model"], **args},
                                  tasks=[CASE["task"]], task_manager=tm, log_samples=True,
                                  samples={CASE["task"]: [int(d) for d in CASE["documents"]]}, **CASE["lm_eval"])
    name, _, filt = CASE["metric"].partition(",")
    return {str(row["doc_id"]): float(row[name]) for row in res["samples"][CASE["task"]]
            if row.get("filter", "none") == (filt or "none")}


def in_fresh_process(index: int) -> dict | None:
    proc = subprocess.run([sys.executable, __file__, "--run", str(index)], capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    print(f"the {CASE['engines'][index]['kv_dtype']} engine did not run (exit {proc.returncode}); the end of its "
          "output:", file=sys.stderr)
    print("\n".join((proc.stdout + proc.stderr).splitlines()[-30:]), file=sys.stderr)
    return None


def main() -> int:
    if sys.argv[1:2] == ["--run"]:
        print(MARK + json.dumps(score(int(sys.argv[2]))), flush=True)
        return 0
    print(f"reproducing: {CASE['title']}")
    print(f"kvdiag saw: {CASE['kvdiag_saw']}")
    got = [in_fresh_process(i) for i in range(2)]
    if None in got:
        return 2
    sign = 1 if CASE["higher_is_better"] else -1
    base, dtype = (engine["kv_dtype"] for engine in CASE["engines"])
    print(f"  document: kvdiag's {base} -> {dtype}; now {base} -> {dtype}")
    lost = seen = 0.0
    for doc, (was_base, was) in CASE["documents"].items():
        now_base, now = got[0].get(doc, float("nan")), got[1].get(doc, float("nan"))
        print(f"  {doc}: {was_base:g} -> {was:g}; now {now_base:g} -> {now:g}")
        seen += sign * (was_base - was)
        lost += sign * (now_base - now)
    print(f"over these {len(CASE['documents'])} documents the {dtype} cache lost {lost:g} ({CASE['metric']}, summed); "
          f"in kvdiag's run {seen:g}")
    if seen > 0 and lost >= seen / 2:
        print(f"REPRODUCED: the {dtype} cache loses {lost:g} of the {seen:g} kvdiag saw")
        return 1
    print(f"NOT REPRODUCED: the {dtype} cache loses {lost:g}, less than half the {seen:g} kvdiag saw")
    return 0


if __name__ == "__main__":
    sys.exit(main())
