"""lm_eval's results of one case -> kvdiag's record: scores and per-document values (``summarize``), each task's
first prompt and answer (``examples``), task groups (``task_groups``), what each task evaluated (``task_hashes``),
the grid cell of each document that has one (``cells``: kv_needle's), what lm_eval scored each document of a
loglikelihood task by (``requests``: a score regression's reproducer carries them inline)."""

from __future__ import annotations

EXAMPLE_CHARS = 4000  # of a prompt kept in the record (a long-context task's would fill results.jsonl)


def _clip(text):
    if not isinstance(text, str) or len(text) <= EXAMPLE_CHARS:
        return text
    half = EXAMPLE_CHARS // 2
    return text[:half] + f" ...[{len(text) - EXAMPLE_CHARS:,} characters]... " + text[-half:]


def task_groups(subtasks: dict) -> dict:
    """{top-level group: [its leaf tasks]} from lm_eval's ``group_subtasks`` (mmlu -> mmlu_stem -> mmlu_anatomy):
    the terminal table shows a group as one row."""
    children = {c for kids in subtasks.values() for c in kids}

    def leaves(name, seen=()):
        kids = subtasks.get(name) or []
        return [name] if not kids else [x for k in kids if k not in seen for x in leaves(k, (*seen, name))]

    return {g: leaves(g) for g, kids in subtasks.items() if kids and g not in children}


def examples(res: dict) -> dict:
    """{task: {"prompt", "response"}} of each task's first document: what the model was given and answered."""
    out = {}
    for task, rows in (res.get("samples") or {}).items():
        if not rows:
            continue
        row = min(rows, key=lambda r: r.get("doc_id", 0))
        args = (row.get("arguments") or [[None]])[0]
        resp = (row.get("resps") or [[None]])[0]
        out[task] = {"prompt": _clip(args[0]) if args else None,
                     "response": _json_value(resp[0] if isinstance(resp, (list, tuple)) and resp else resp)}
    return out


def summarize(res: dict) -> dict:
    """lm_eval's results -> ``scores`` {task: {metric: {score, stderr, higher_is_better, n}}} and ``samples``
    {task: {metric: {doc_id: value}}}. A metric of filter ``f`` other than ``none`` is named ``metric,f``."""
    samples: dict = {}
    for task, rows in (res.get("samples") or {}).items():
        per = samples.setdefault(task, {})
        for row in rows:
            suffix = "" if row.get("filter", "none") == "none" else f",{row['filter']}"
            for metric in row["metrics"]:
                per.setdefault(metric + suffix, {})[str(row["doc_id"])] = _json_value(row[metric])
    scores: dict = {}
    for task, per in samples.items():
        got = res["results"].get(task, {})
        hib = (res.get("higher_is_better") or {}).get(task, {})
        for metric in per:
            name, _, filt = metric.partition(",")
            key = f"{name},{filt or 'none'}"
            stderr = got.get(f"{name}_stderr,{filt or 'none'}")
            scores.setdefault(task, {})[metric] = {
                "score": _json_value(got.get(key)),
                "stderr": stderr if isinstance(stderr, (int, float)) else float("nan"),
                "higher_is_better": hib.get(name, True),
                "n": len(per[metric]),
            }
    return {"scores": scores, "samples": samples}


def cells(res: dict) -> dict:
    """{task: {doc_id: [length, depth]}} of the documents tagged with a grid cell (``needle_length``,
    ``needle_depth``: kvdiag.tasks.needle); tasks without them are left out."""
    out: dict = {}
    for task, rows in (res.get("samples") or {}).items():
        for row in rows:
            doc = row.get("doc") or {}
            if isinstance(doc, dict) and "needle_length" in doc and "needle_depth" in doc:
                out.setdefault(task, {})[str(row["doc_id"])] = [int(doc["needle_length"]), float(doc["needle_depth"])]
    return out


SCORED = ("multiple_choice", "loglikelihood")  # the output types whose documents a reproducer scores without the task


def requests(res: dict) -> dict:
    """{task: {doc_id: {"type", "arguments": [[context, continuation], ...], "gold", "chars"}}} of the tasks whose
    documents are scored by loglikelihood alone (``SCORED``): lm_eval's requests as it made them (prompt, few-shot
    examples and chat template applied), the gold choice's index (a list for several) and each choice's length in
    characters without the target delimiter (``acc_norm``'s divisor), as ``ConfigurableTask.process_results`` takes
    them. A document whose gold is not among its choices is left out."""
    out: dict = {}
    for task, rows in (res.get("samples") or {}).items():
        cfg = (res.get("configs") or {}).get(task) or {}
        kind, delim = cfg.get("output_type"), cfg.get("target_delimiter", " ")
        if kind not in SCORED:
            continue
        docs = out.setdefault(task, {})
        for row in rows:
            args = [list(a) for a in row.get("arguments") or ()]
            if str(row.get("doc_id")) in docs or not args or any(len(a) != 2 for a in args):
                continue
            choices = [c[len(delim):] if delim and c.startswith(delim) else c for _, c in args]
            gold = _gold(row.get("target"), choices) if kind == "multiple_choice" else None
            if kind == "multiple_choice" and gold is None:
                continue
            docs[str(row["doc_id"])] = {"type": kind, "arguments": args, "gold": gold,
                                        "chars": [len(c) for c in choices]}
    return {t: d for t, d in out.items() if d}


def _gold(target, choices: list[str]):
    """The gold choice's index (a list of them for several), as lm_eval reads a target; None when it is not one."""
    if isinstance(target, list):
        got = [_gold(t, choices) for t in target]
        return None if None in got else got
    if isinstance(target, str) and target.strip().isdigit() and target not in choices:
        target = int(target)
    if isinstance(target, int) and not isinstance(target, bool):
        return target if 0 <= target < len(choices) else None
    return choices.index(target) if target in choices else None


def _json_value(v):
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, (list, tuple)):
        return [_json_value(x) for x in v]
    if hasattr(v, "item"):
        return _json_value(v.item())
    return float("nan") if v is None else str(v)


def task_hashes(res: dict) -> dict:
    """{task: {hash, documents_hash, documents, version, dataset}} of what each task evaluated: ``hash`` is lm_eval's
    task hash (its EvaluationTracker's ``task_hashes``: sha256 over every sample's document, prompt and target
    hashes), ``documents_hash`` the documents alone (sha256 over their hashes in doc_id order: the dataset as
    evaluated, whatever the prompt format), ``dataset`` the task's dataset_path, dataset_name and revision."""
    from lm_eval.utils import hash_string

    out = {}
    for task, rows in (res.get("samples") or {}).items():
        docs = {}
        for row in rows:
            docs.setdefault(row["doc_id"], row["doc_hash"])
        cfg = (res.get("configs") or {}).get(task) or {}
        out[task] = {"hash": hash_string("".join(r["doc_hash"] + r["prompt_hash"] + r["target_hash"] for r in rows)),
                     "documents_hash": hash_string("".join(docs[k] for k in sorted(docs))), "documents": len(docs),
                     "version": _json_value((res.get("versions") or {}).get(task)),
                     "dataset": {"path": cfg.get("dataset_path"), "name": cfg.get("dataset_name"),
                                 "revision": (cfg.get("dataset_kwargs") or {}).get("revision")}}
    return out
