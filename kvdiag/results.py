"""The result schema: one record per case, one run record per command (docs/DESIGN.md, "Results and exit codes").

``results.jsonl`` is append-only: a case may be recorded again later in the same run
(after the cross-case analysis gives its verdict); the last record of an id wins.
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

SCHEMA_VERSION = 1  # of run.json; 1: schema_version, environment.kvdiag_commit/kvdiag_dirty, models, tasks
# unsupported: the engine refuses this case (a kv dtype no attention backend of this platform takes, no sleep mode,
# no KV access), in its own words; crashed: the engine failed (an exception from it, or its worker died);
# error: kvdiag could not run or judge the case (out of device memory, a case function that raised).
# skipped: what earlier kvdiag versions recorded for unsupported (read back, never written).
STATUSES = ("pass", "fail", "error", "crashed", "timeout", "unsupported", "skipped")
BAD_STATUSES = ("fail", "error", "crashed", "timeout")
NOT_RUN_STATUSES = ("unsupported", "skipped")  # the engine refused the case: no verdict, not a failure


@dataclass
class Finding:
    severity: str  # error | warning | info
    kind: str  # short machine name: "tensor_survived", "divergence", "regression", ...
    message: str  # one line a person reads
    evidence: dict = field(default_factory=dict)


@dataclass
class CaseResult:
    id: str
    check: str
    engine: str
    model: str
    kv_dtype: str
    status: str
    metrics: dict = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)
    duration_s: float = 0.0
    params: dict = field(default_factory=dict)
    log_tail: str | None = None
    environment: dict = field(default_factory=dict)  # what the worker saw (device, versions)

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"bad status {self.status!r}")
        self.findings = [f if isinstance(f, Finding) else Finding(**f) for f in self.findings]

    def to_json(self) -> dict:
        return _clean(asdict(self))

    @classmethod
    def from_json(cls, d: dict) -> "CaseResult":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    def add(self, severity: str, kind: str, message: str, **evidence) -> Finding:
        f = Finding(severity, kind, message, evidence)
        self.findings.append(f)
        return f


def _clean(obj):
    """Make a value JSON-safe: NaN/inf become strings, tuples lists, unknown objects str()."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else str(obj)
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if obj is None or isinstance(obj, (str, int, bool)):
        return obj
    if hasattr(obj, "item"):  # numpy / torch scalars
        return _clean(obj.item())
    return str(obj)


def append_jsonl(path: Path, record: CaseResult) -> None:
    """Append one record and fsync, so a killed kvdiag loses no finished case."""
    line = json.dumps(record.to_json(), sort_keys=False) + "\n"
    if _ends_mid_line(path):  # a kvdiag killed mid-write left half a line: keep it apart from this record
        line = "\n" + line
    with open(path, "a", encoding="utf-8") as f:
        f.write(line)
        f.flush()
        os.fsync(f.fileno())


def write_jsonl(path: Path, records: list[CaseResult]) -> None:
    """results.jsonl anew with one record per case (a finished run's final ones), in one atomic replace."""
    tmp = Path(path).with_name(Path(path).name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r.to_json(), sort_keys=False) + "\n" for r in records)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _ends_mid_line(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            return f.read(1) != b"\n"
    except OSError:  # missing or empty
        return False


def read_jsonl(path: Path, warn=None) -> dict[str, CaseResult]:
    """Read results.jsonl: the last record of each id wins; a corrupt line is reported and skipped."""
    out: dict[str, CaseResult] = {}
    if not Path(path).exists():
        return out
    warn = warn or (lambda msg: print(f"kvdiag: warning: {msg}", file=sys.stderr))
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = CaseResult.from_json(json.loads(line))
            except (ValueError, TypeError, AttributeError) as e:  # bad JSON, a wrong field, not an object
                warn(f"{path}:{lineno}: skipped a corrupt record ({type(e).__name__}: {e})")
                continue
            out.pop(rec.id, None)  # keep insertion order = order of last record
            out[rec.id] = rec
    return out


@dataclass
class RunRecord:
    command: str
    started: str
    cases: list[CaseResult]
    environment: dict
    finished: str | None = None
    exit_code: int | None = None
    run_dir: str | None = None
    summary: dict = field(default_factory=dict)
    analysis: dict = field(default_factory=dict)  # cross-case results (comparisons, matrices)
    shard: dict = field(default_factory=dict)  # kvdiag ci --shard: suite, index, count (kvdiag.run.shards)
    # model folder -> revision and content hash (kvdiag.run.provenance)
    models: dict = field(default_factory=dict)
    call: dict | None = None  # the check, engine, model, dtypes and options the run was made with (kvdiag.run.resume)
    plan: list = field(default_factory=list)  # [case id, hash of its arguments] per case: what --resume must match
    schema_version: int | None = SCHEMA_VERSION  # None: a run.json written before run.json had a version

    def to_json(self) -> dict:
        d = _clean(asdict(self))
        d["cases"] = [c.to_json() for c in self.cases]
        d["tasks"] = tasks_record(self.cases)
        return {"schema_version": d.pop("schema_version"), **d}

    @classmethod
    def from_json(cls, d: dict) -> "RunRecord":
        known = {f.name for f in fields(cls)}
        d = {"schema_version": None, **{k: v for k, v in d.items() if k in known}}
        d["cases"] = [CaseResult.from_json(c) for c in d.get("cases", [])]
        return cls(**d)


def tasks_record(cases: list[CaseResult]) -> dict:
    """{task: [{hash, documents_hash, documents, version, dataset, cases}]}: what each lm_eval task evaluated, from the
    accuracy cases' records (``metrics.lm_eval.tasks``); one entry per distinct record, naming its cases (usually
    one: every kv dtype sees the same documents and prompts)."""
    out: dict = {}
    for c in cases:
        for task, rec in ((c.metrics.get("lm_eval") or {}).get("tasks") or {}).items():
            entries = out.setdefault(task, [])
            same = next((e for e in entries if {k: v for k, v in e.items() if k != "cases"} == rec), None)
            if same is None:
                entries.append({**rec, "cases": [c.id]})
            else:
                same["cases"].append(c.id)
    return out


def summarize(cases: list[CaseResult]) -> dict:
    counts = {s: 0 for s in STATUSES}
    for c in cases:
        counts[c.status] += 1
    return counts


def exit_code_for(cases: list[CaseResult]) -> int:
    return 1 if any(c.status in BAD_STATUSES for c in cases) else 0


def write_run_json(run_dir: Path, run: RunRecord) -> Path:
    path = Path(run_dir) / "run.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(run.to_json(), indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def load_run(run_dir: Path) -> RunRecord:
    """Load a run directory: run.json if present, with results.jsonl as the source of cases."""
    from kvdiag.errors import UserError

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserError(f"run directory not found: {run_dir}")
    run_json = run_dir / "run.json"
    run = None
    if run_json.exists():
        try:
            run = RunRecord.from_json(json.loads(run_json.read_text(encoding="utf-8")))
        except (ValueError, TypeError) as e:
            print(f"kvdiag: warning: {run_json}: unreadable ({e}); using results.jsonl", file=sys.stderr)
    cases = read_jsonl(run_dir / "results.jsonl")
    if run is None:
        if not cases:
            raise UserError(f"{run_dir} holds no run.json and no readable results.jsonl")
        run = RunRecord(command="?", started="?", cases=[], environment={})
    if cases:  # results.jsonl's records (the newest per case), in run.json's order (the command's), then the rest
        order = {c.id: i for i, c in enumerate(run.cases)}
        run.cases = sorted(cases.values(), key=lambda c: order.get(c.id, len(order)))
    run.summary = summarize(run.cases)
    run.run_dir = str(run_dir)  # where it is now (a copied or moved run finds its artifacts)
    return run


# ------------------------------------------------------------------ as pandas DataFrames

CASE_COLUMNS = ("id", "check", "engine", "model", "kv_dtype", "status")
NOT_FLAT = ("scores", "artifacts", "lm_eval")  # scores: scores_frame; lm_eval: prompts and settings, not numbers


def _run(run) -> RunRecord:
    return run if isinstance(run, RunRecord) else load_run(Path(run))


def cases_frame(run):
    """One row per case of a run (a RunRecord or a run directory): its id, check, engine, model, kv dtype, status,
    verdict, duration, error count and first error, and every scalar metric flattened (``timings.drift``)."""
    import pandas as pd

    rows = []
    for c in _run(run).cases:
        errors = [f.message for f in c.findings if f.severity == "error"]
        rows.append({**{k: getattr(c, k) for k in CASE_COLUMNS}, "verdict": c.metrics.get("verdict"),
                     "duration_s": c.duration_s, "errors": len(errors), "first_error": errors[0] if errors else None,
                     **_scalars(c.metrics)})
    return pd.DataFrame(rows)


def _scalars(metrics: dict, prefix: str = "") -> dict:
    """The metrics' numbers, strings and booleans, nested keys joined by dots (``timings.drift``)."""
    out = {}
    for k, v in metrics.items():
        if not prefix and k in NOT_FLAT:
            continue
        if isinstance(v, dict):
            out.update(_scalars(v, f"{prefix}{k}."))
        elif isinstance(v, (int, float, str, bool)):
            out[prefix + k] = v
    return out


SCORE_KEEP = ("baseline", "delta", "ci_low", "ci_high", "p_value", "test", "mean_kl", "max_kl", "top1_agreement",
              "verdict")


def scores_frame(run):
    """One row per case x task x metric of a run (a RunRecord or a run directory). Columns: the case's ``id``,
    ``check``, ``engine``, ``model``, ``kv_dtype`` and ``status``; ``task``, ``metric``, ``value`` (the score),
    ``stderr`` and ``n`` (documents); for accuracy, the comparison with the baseline dtype: ``baseline`` (its score),
    ``delta``, ``ci_low`` / ``ci_high`` (delta's paired 95% CI), ``p_value``, ``test``, the case's drift
    (``mean_kl``, ``max_kl``, ``top1_agreement``: the same on each of its rows) and ``verdict``; ``message``: why a
    case has no value. A case that did not score (crashed, unsupported, timeout, error) is still there: one row per
    task x metric that the other cases of its check scored (one row, task and metric empty, when none did), with
    ``value`` NaN and its status, so that a pivot by kv dtype shows it. A case without task scores (memleak,
    wake-cycle, ...) gives one row per scalar metric, task empty."""
    import pandas as pd

    run = _run(run)
    judged = {(r["kv_dtype"], r["task"], r["metric"]): r for a in run.analysis.values() if isinstance(a, dict)
              for r in a.get("rows") or () if isinstance(r, dict) and "task" in r and "metric" in r}
    scored: dict[str, dict] = {}  # check -> its (task, metric) pairs in order: a case that did not score gets them
    for c in run.cases:
        for task, per in (c.metrics.get("scores") or {}).items():
            scored.setdefault(c.check, {}).update(dict.fromkeys((task, m) for m in per))
    tasked = set(scored) | {c.check for c in run.cases if (c.kv_dtype, "-", "-") in judged}
    rows = []
    for c in run.cases:
        head = {k: getattr(c, k) for k in CASE_COLUMNS}
        for task, per in (c.metrics.get("scores") or {}).items():
            for metric, sc in per.items():
                r = judged.get((c.kv_dtype, task, metric), {})
                rows.append({**head, "task": task, "metric": metric, "value": sc.get("score"),
                             "stderr": sc.get("stderr"), "n": sc.get("n"), **{k: r.get(k) for k in SCORE_KEEP}})
        if "scores" in c.metrics:
            continue
        if c.check in tasked:
            r = judged.get((c.kv_dtype, "-", "-"), {})
            why = {**{k: r.get(k, c.metrics.get(k)) for k in ("mean_kl", "max_kl", "top1_agreement")},  # a kept drift
                   "verdict": r.get("verdict", c.metrics.get("verdict")), "message": r.get("message", _why(c))}
            rows += [{**head, "task": task, "metric": metric, **why} for task, metric in scored.get(c.check) or
                     [(None, None)]]
            continue
        mine = [{**head, "task": "", "metric": metric, "value": value, "verdict": c.metrics.get("verdict")}
                for metric, value in _scalars(c.metrics).items()
                if metric != "verdict" and isinstance(value, (int, float)) and not isinstance(value, bool)]
        rows += mine or [{**head, "task": "", "metric": None, "verdict": c.metrics.get("verdict"),
                          "message": _why(c)}]
    df = pd.DataFrame(rows, columns=[*CASE_COLUMNS, "task", "metric", "value", "stderr", "n", *SCORE_KEEP,
                                     "message"])
    for col in ("value", "stderr"):  # NaN, not None, where no case scored: float columns whatever the run
        df[col] = pd.to_numeric(df[col])
    return df


def _why(c: CaseResult) -> str | None:
    """A case's first error, else its first finding (an unsupported case's reason is an info)."""
    first = next((f for f in c.findings if f.severity == "error"), c.findings[0] if c.findings else None)
    return first.message if first else None


def samples_frame(run):
    """One row per case x task x metric x document of an accuracy run: the document's value (0/1 for acc), read
    from each case's samples artifact in turn."""
    import pandas as pd

    run = _run(run)
    parts = []
    for c in run.cases:
        name = (c.metrics.get("artifacts") or {}).get("samples")
        path = Path(run.run_dir or ".") / "artifacts" / name if name else None
        if path is None or not path.is_file():
            continue
        for task, per in json.loads(path.read_text()).items():
            for metric, docs in per.items():
                parts.append(pd.DataFrame({"id": c.id, "kv_dtype": c.kv_dtype, "task": task, "metric": metric,
                                           "doc_id": list(docs), "value": list(docs.values())}))
    cols = ["id", "kv_dtype", "task", "metric", "doc_id", "value"]
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=cols)
