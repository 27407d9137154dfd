#!/usr/bin/env python3
"""A score regression kvdiag's accuracy check found, shown with lm_eval and vLLM alone.

The documents whose score changed between the baseline kv dtype and the dtype (by doc id within the task, listed
below with the scores kvdiag saw) are scored again, once per dtype, each in a fresh process with every engine argument
and environment variable kvdiag gave that dtype's engine: by lm_eval's own vLLM backend with the lm_eval settings of
the run, or a generation task's answers by vLLM and scored by lm_eval's task (below; the answers are printed under
each document). The regression reproduces when the dtype again loses, over these documents, at least half of what it
lost in kvdiag's run.

    python3 THIS_FILE            # exit 1: the regression reproduces; 0: it does not; 2: an engine did not run
    python3 THIS_FILE --run 0    # the baseline dtype's scores (and answers) alone, as JSON (--run 1: the dtype's)

Needs lm_eval and vLLM (and its torch). A task scored by loglikelihood (multiple choice) has its documents inline:
``CASE["requests"]``, each document's (context, continuation) pairs as lm_eval made them (few-shot examples and chat
template applied), its gold choice and its choices' lengths; they are scored by lm_eval's vLLM backend, without the
task or its dataset. A generation task (``generate_until``) has them inline too: each document's context as lm_eval
rendered it and its generation arguments, answered by vLLM as kvdiag's lm_eval model asked it (the prompt's tokens,
greedy, cut at the first stop string; a conversation of kvdiag's, turns joined by TURN, turn by turn), and the
document itself with the task's scoring, ``CASE["generation"]["config"]`` (its filters, metrics, target and any
Python function of it as its file's text): lm_eval builds the task from these documents alone and filters and scores
each answer as the task does. Otherwise the documents come from the task's own dataset (a task shipped with kvdiag
is read from the task folder named in CASE; the line under the first says why). CASE is what kvdiag recorded; edit
it to try another configuration.
"""

import json
import os
import subprocess
import sys

CASE: dict = {}  # filled in by kvdiag: the task, its documents and scores, the two engines, lm_eval's settings
MARK = "@@reproducer-output "
TURN = "\x1e"  # joins a conversation's turns in its context and their answers (kvdiag's kv_decode, kv_multiturn)


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


def loaded(value):
    """The carried config with each ``{"@function": name, "source": its file's text}`` the function again."""
    if isinstance(value, dict) and "@function" in value:
        space = {"__name__": "task_functions"}
        exec(compile(value["source"], f"<the file of {value['@function']}>", "exec"), space)
        return space[value["@function"]]
    if isinstance(value, dict):
        return {k: loaded(v) for k, v in value.items()}
    return [loaded(v) for v in value] if isinstance(value, list) else value


def task_of(scoring: dict, docs: list):
    """lm_eval's ConfigurableTask of the carried config over ``docs`` alone (no dataset, no task folder; the prompt
    is carried rendered, so the task renders none)."""
    import datasets
    from lm_eval.api.task import ConfigurableTask

    data = datasets.DatasetDict({"test": datasets.Dataset.from_list(docs)})
    return ConfigurableTask(config={**loaded(scoring["config"]), "custom_dataset": lambda **_: data,
                                    "test_split": "test", "doc_to_text": ""})


def scored(task, metric: str, docs: dict, answers: dict) -> dict:
    """{doc id: ``metric``'s value} of each answer to the document ``docs[doc id]``, as lm_eval's evaluator scores
    it: the task's filters over the answers, then its ``process_results`` of the document and the answer the
    metric's filter (``metric,filter``; ``none`` by default) gave."""
    from lm_eval.api.instance import Instance

    name, _, filt = metric.partition(",")
    held = []
    for i, (doc, answer) in enumerate(answers.items()):
        held.append(Instance("generate_until", docs[doc], ("", {}), 0, (task.config.task, i, 1)))
        held[-1].resps.append(answer)
    task._instances = held
    task.apply_filters()
    return {doc: float(task.process_results(docs[doc], [h.filtered_resps[filt or "none"]])[name])
            for doc, h in zip(answers, held)}


def generated(engine: dict) -> dict:
    """{doc id: vLLM's answer} to each document's request, asked as kvdiag's lm_eval model asks: the prompt's tokens
    with their start cut to leave room for the answer, greedy unless the request samples, the answer cut at its first
    stop string; a conversation's turns in sequence, turn k's prompt turn k-1's, its answer and turn k's text."""
    from lm_eval.models.utils import normalize_gen_kwargs
    from vllm import LLM, SamplingParams

    gen = CASE["generation"]
    llm = LLM(**engine["llm"])
    tokenizer = llm.get_tokenizer()
    jobs = {}
    for doc, r in CASE["requests"].items():
        context, kwargs = r["arguments"][0]
        kw = normalize_gen_kwargs(dict(kwargs or {}), gen["max_gen_toks"])
        until = kw.get("until") or []
        jobs[doc] = (context.split(TURN), tuple([until] if isinstance(until, str) else until),
                     int(kw["max_gen_toks"]), bool(kw.get("do_sample")))
    text = {doc: job[0][0] for doc, job in jobs.items()}
    answers: dict = {doc: [] for doc in jobs}
    for k in range(max(len(job[0]) for job in jobs.values())):
        live = [doc for doc in jobs if k < len(jobs[doc][0])]
        if k:
            for doc in live:
                text[doc] += answers[doc][-1] + jobs[doc][0][k]
        for until, n, sample in dict.fromkeys(jobs[doc][1:] for doc in live):
            same = [doc for doc in live if jobs[doc][1:] == (until, n, sample)]
            keep = max(1, gen["max_length"] - n)
            params = SamplingParams(max_tokens=n, temperature=1.0 if sample else 0.0, logprobs=0,
                                    seed=gen["seed"] if sample else None, stop=list(until) or None,
                                    **engine["sampling"])
            outs = llm.generate([{"prompt_token_ids": tokenizer.encode(text[doc])[-keep:]} for doc in same], params)
            for doc, out in zip(same, outs):
                answer = out.outputs[0].text or ""
                for stop in until:
                    answer = answer.split(stop)[0] if stop else answer
                answers[doc].append(answer)
    return {doc: TURN.join(a) for doc, a in answers.items()}


def score(index: int) -> tuple:
    """({doc id: the metric's value}, {doc id: the answer} of a generation task) of the documents, scored by lm_eval
    with engine ``index``'s vLLM."""
    engine = CASE["engines"][index]
    os.environ.update(engine["env"])
    if CASE.get("generation"):
        import logging

        logging.getLogger("lm_eval").setLevel(logging.ERROR)  # its notes on a task config built in memory
        answers = generated(engine)
        docs = {doc: r["doc"] for doc, r in CASE["requests"].items()}
        return scored(task_of(CASE["generation"], list(docs.values())), CASE["metric"], docs, answers), answers
    if CASE.get("requests"):
        return score_inline(engine), {}
    import lm_eval
    from lm_eval.tasks import TaskManager

    args = {k: v for k, v in engine["llm"].items() if k != "model"}
    tm = TaskManager(include_path=CASE["include_path"] or None, include_defaults=CASE["include_defaults"])
    res = lm_eval.simple_evaluate(model="vllm", model_args={"pretrained": engine["llm"]["model"], **args},
                                  tasks=[CASE["task"]], task_manager=tm, log_samples=True,
                                  samples={CASE["task"]: [int(d) for d in CASE["documents"]]}, **CASE["lm_eval"])
    name, _, filt = CASE["metric"].partition(",")
    return {str(row["doc_id"]): float(row[name]) for row in res["samples"][CASE["task"]]
            if row.get("filter", "none") == (filt or "none")}, {}


def in_fresh_process(index: int) -> dict | None:
    proc = subprocess.run([sys.executable, __file__, "--run", str(index)], capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    print(f"the {CASE['engines'][index]['kv_dtype']} engine did not run (exit {proc.returncode}); the end of its "
          "output:", file=sys.stderr)
    print("\n".join((proc.stdout + proc.stderr).splitlines()[-30:]), file=sys.stderr)
    return None


def clip(text, most: int = 48) -> str:
    text = repr(text).replace(TURN.encode("unicode_escape").decode(), " | ")
    return text if len(text) <= most else text[:most - 5] + "...'"


def main() -> int:
    if sys.argv[1:2] == ["--run"]:
        scores, answers = score(int(sys.argv[2]))
        print(MARK + json.dumps({"scores": scores, "answers": answers}), flush=True)
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
        now_base, now = (got[i]["scores"].get(doc, float("nan")) for i in range(2))
        print(f"  {doc}: {was_base:g} -> {was:g}; now {now_base:g} -> {now:g}")
        if doc in got[0]["answers"]:
            print(f"    target {clip(CASE['requests'][doc]['target'])}; {base} answers "
                  f"{clip(got[0]['answers'][doc])}, {dtype} {clip(got[1]['answers'][doc])}")
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
