"""What a generation task's score-regression reproducer carries inline (``kvdiag/proof/lm_eval_docs_script.py``):
each document's ``generate_until`` request as lm_eval made it (the context rendered, few-shot examples and chat
template applied, and its generation arguments), the document itself, its target and the answer the baseline gave
(``generations``); and the task's scoring, its config as lm_eval used it less its data and prompt, each Python
function in it carried as the source of its file (``scoring``), so that lm_eval builds the task from the documents
alone, with no task folder and no dataset, and filters and scores an answer as the task does."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

SCORING = "@scoring"  # the requests artifact's key of the tasks' scoring (no lm_eval task is named so)
KEYS = ("task", "output_type", "doc_to_target", "doc_to_choice", "target_delimiter", "process_results",
        "metric_list", "filter_list", "generation_kwargs", "repeats")  # what scoring an answer reads


def generations(res: dict) -> dict:
    """{task: {doc_id: {"type", "arguments": [[context, gen_kwargs]], "doc", "target", "response"}}} of the
    ``generate_until`` tasks: one request per document (a task of repeats has none), a document that JSON cannot
    hold (an image) left out."""
    out: dict = {}
    for task, rows in (res.get("samples") or {}).items():
        if ((res.get("configs") or {}).get(task) or {}).get("output_type") != "generate_until":
            continue
        docs = out.setdefault(task, {})
        for row in rows:
            args, resps = row.get("arguments") or (), row.get("resps") or ()
            if str(row.get("doc_id")) in docs or len(args) != 1 or len(resps) != 1 or len(resps[0]) != 1:
                continue
            item = {"type": "generate_until", "arguments": [list(args[0])], "doc": row.get("doc"),
                    "target": row.get("target"), "response": resps[0][0]}
            try:
                docs[str(row["doc_id"])] = json.loads(json.dumps(item))
            except (TypeError, ValueError):
                continue
    return {t: d for t, d in out.items() if d}


def scoring(task) -> dict:
    """The scoring of an lm_eval ``ConfigurableTask`` of output ``generate_until``, as a JSON object: ``config``,
    the TaskConfig keys that scoring an answer reads (``KEYS``), each Python function among them as
    ``{"@function": name, "source": its file's text}``; or ``{"refused": why}`` where one cannot be carried so."""
    config = getattr(task, "config", None)
    if config is None or getattr(config, "output_type", None) != "generate_until":
        return {"refused": "not a generate_until task of lm_eval's ConfigurableTask"}
    try:
        carried = {k: _carried(getattr(config, k)) for k in KEYS if getattr(config, k, None) is not None}
        return {"config": json.loads(json.dumps(carried))}
    except Exception as e:  # noqa: BLE001 - a task's config of any shape: its reproducer reads the dataset, saying why
        return {"refused": f"{type(e).__name__}: {e}"[:300]}


def _carried(value):
    if isinstance(value, dict):
        return {k: _carried(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_carried(v) for v in value]
    if callable(value) and not isinstance(value, type):
        name = getattr(value, "__name__", "")
        if not inspect.isfunction(value) or not name.isidentifier():
            raise TypeError(f"the task's scoring calls {value!r}, no named function of a file")
        return {"@function": name, "source": Path(inspect.getsourcefile(value)).read_text(encoding="utf-8")}
    return value
