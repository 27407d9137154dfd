"""`kvdiag dtypes --check`: the support matrix of an engine's kv dtypes.

For every dtype string the engine knows: does the engine start with it, does a short
greedy generation come back finite, is an explicit unquantized dtype equal to the
model's dtype bit-identical to ``auto``, is the drift against ``auto`` within the
dtype family's limits (KL growing with the position: a ``drift_grows`` warning, the
row still passes). Rows: ``pass``, ``unsupported`` (the engine's own words),
``resource`` (the device ran out of memory: another engine on the GPU, most often; an
error of the run, never ``unsupported``), ``crashed``, ``wrong``. An explicit unquantized
dtype equal to the model's dtype is what ``auto`` stores: refusing it while ``auto`` works
is ``wrong`` (bug S1), not ``unsupported``. Each dtype runs in its own worker, so one bad
dtype never stops the matrix.

Each row also says what the cache really stores, read from the engine's cache tensors
(``kv_blocks()``; nothing for engines without KV access): the element dtype per layer,
bytes per token of K+V and of the scales. A dtype named as quantized that stores layers
at the model's precision gets a ``not_quantized`` warning (the row still passes).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvdiag.checks import drift
from kvdiag.checks.accuracy import DRIFT, compiled, drift_limit, model_dtype
from kvdiag.checks.common import engine_failed, start_or_record
from kvdiag.checks.engine_use import acquire_engine, release_engine
from kvdiag.checks.registry import Check
from kvdiag.errors import EngineUnsupported
from kvdiag.results import NOT_RUN_STATUSES


@dataclass
class DtypesParams:
    max_kl: float | None = drift_limit("max_kl")
    min_top1: float | None = drift_limit("min_top1")


def run_case(case, ctx):
    """Start the engine with one dtype and probe it (the drift prompts, teacher-forced and greedy)."""
    from kvdiag.checks.prompts import case_prompts

    ctx.stage(case, "engine start")
    engine, refused_rec = start_or_record(case, acquire_engine)
    if refused_rec is not None:
        refused_rec.metrics["row"] = refused_rec.status if refused_rec.status != "error" else "resource"
        return refused_rec
    ctx.stage(case, "drift probe")
    try:
        probe = drift.collect(engine, case_prompts(case))
    except Exception as e:  # noqa: BLE001 - it started, then failed: a crash of this dtype, not of kvdiag
        return engine_failed(case, e, "drift probe", started=True)
    path = ctx.artifact(case, DRIFT)
    drift.save(probe, path)
    rec = case.result("pass", metrics={"started": True, "model_dtype": model_dtype(engine, case),
                                       "compiled": compiled(engine),
                                       "finite": drift.finite(probe), "drift_over": probe["over"],
                                       "storage": cache_storage(engine), "artifacts": {"drift": path.name}})
    release_engine(case, engine)
    return rec


def cache_storage(engine) -> dict | None:
    """What the engine's cache stores: ``kv_tensors.storage_summary`` of its tensors and, as ``kinds``, the storage
    audit of its layer kinds (``storage_audit``: the engine's ``kv_layer_specs()``, else its tensors as full
    attention); None when neither is known."""
    from kvdiag.checks import storage_audit
    from kvdiag.checks.kv_tensors import storage_summary

    try:
        view = engine.kv_blocks()
    except (EngineUnsupported, NotImplementedError):
        view = None
    specs = getattr(engine, "kv_layer_specs", None)
    layers = specs() if callable(specs) else None
    if layers is None and view is not None:
        layers = storage_audit.view_layers(view)
    if view is None and not layers:
        return None
    st = storage_summary(view) if view is not None else {}
    return {**st, "kinds": storage_audit.audit(layers or [])}


def analyze(run, *, max_kl: float | None = None, min_top1: float | None = None) -> None:
    from kvdiag.checks.verdicts import position_row, reset
    from kvdiag.results import append_jsonl

    folder = Path(run.run_dir) / "artifacts"
    for rec in run.cases:
        reset(rec)
    base = next((c for c in run.cases if c.params.get("role") == "baseline"), None)
    usable = base is not None and base.status == "pass" and base.metrics.get("finite")
    base_probe = _probe(folder, base) if usable else None
    rows = []
    for rec in run.cases:
        row = {**_row(rec, base, base_probe, folder, max_kl, min_top1), **storage_row(rec)}
        rows.append(row)
        rec.metrics["row"] = row["result"]
        if row["result"] == "wrong":
            rec.status = "fail"
            rec.add("error", "wrong", row["detail"])
        warnings = [("not_quantized", row["not_quantized"], {})] if row["not_quantized"] else []
        warnings += row.pop("drift_warnings")
        for kind, msg, evidence in warnings:
            rec.add("warning", kind, msg, **evidence)
            row["detail"] = "; ".join(x for x in (row["detail"], msg) if x)
        if rec.status in ("pass", "fail"):
            append_jsonl(Path(run.run_dir) / "results.jsonl", rec)
    run.analysis["dtypes"] = {"baseline": base.kv_dtype if base else None, "rows": rows,
                              "drift_by_position": [r for r in map(position_row, run.cases) if r]}


def _row(rec, base, base_probe, folder: Path, max_kl, min_top1) -> dict:
    started = bool(rec.metrics.get("started", rec.status == "pass"))
    row = {"kv_dtype": rec.kv_dtype, "result": "pass", "started": started,
           "finite": rec.metrics.get("finite"), "identical_to_auto": None, "mean_kl": None, "top1_agreement": None,
           "detail": "", "drift_warnings": []}
    first = rec.findings[0].message if rec.findings else ""
    if rec.status in NOT_RUN_STATUSES:
        wrong = drift.wrongly_refused(rec, base)
        if wrong:
            return {**row, "result": "wrong", "detail": wrong}
        return {**row, "result": "unsupported", "detail": rec.metrics.get("reason", first)}
    if rec.status != "pass":
        resource = next((f.message for f in rec.findings if f.kind == "resource"), None)
        if resource:  # out of memory: an error of the run, not the engine refusing the dtype
            return {**row, "result": "resource", "detail": resource}
        return {**row, "result": "crashed", "detail": first or rec.status}
    if not rec.metrics.get("finite"):
        return {**row, "result": "wrong", "detail": "non-finite logprobs from a short greedy generation"}
    if rec is base:
        return {**row, "identical_to_auto": True, "mean_kl": 0.0, "top1_agreement": 1.0}
    if base_probe is None:
        return {**row, "detail": "no usable baseline 'auto' to compare with"}
    d = drift.compare(base_probe, _probe(folder, rec))
    lim = drift.limits_for(rec.kv_dtype, base.metrics.get("model_dtype"), compiled=drift.compiled_pair(rec, base),
                           max_kl=max_kl, min_top1=min_top1)
    rec.metrics.update(drift=d, drift_limits=lim.to_json())
    row.update(identical_to_auto=d["identical"] if lim.family in drift.UNQUANTIZED_FAMILIES else None,
               mean_kl=d["mean_kl"], top1_agreement=d["top1_agreement"], drift_warnings=drift.warnings(d, lim))
    problems = drift.judge(d, lim)
    if problems:
        return {**row, "result": "wrong", "detail": "; ".join(problems)}
    return row


def _probe(folder: Path, rec) -> dict:
    return drift.load(folder / rec.metrics["artifacts"]["drift"])


def storage_row(rec) -> dict:
    """The row's storage columns: ``stores`` (e.g. ``int8 +scales``, ``bf16 (2/2 layers)``), ``layers`` (the storage
    audit: each layer kind, its count, element dtype and bytes per token or per sequence), ``kv_bytes_per_token``
    (K+V over all layers), ``scale_bytes_per_token``, ``storage`` (the case's summary) and ``not_quantized``
    (the warning when a dtype named as quantized stores layers at the model's precision, else None)."""
    from collections import Counter

    from kvdiag.checks.storage_audit import SHORT, summary

    st = rec.metrics.get("storage")
    if not st:
        return {"stores": None, "layers": None, "kv_bytes_per_token": None, "scale_bytes_per_token": None,
                "storage": None, "not_quantized": None}
    layer_dtypes = st.get("layer_dtypes") or [k["dtype"] for k in st.get("kinds", []) for _ in range(k["count"])]
    n_layers = st.get("layers", len(layer_dtypes))
    full = _full_precision(rec.kv_dtype, layer_dtypes, st.get("element_bytes", {}), rec.metrics.get("model_dtype"))
    counts = Counter(layer_dtypes)
    names = {d: "/".join(SHORT.get(x, x) for x in d.split("/")) for d in counts}
    stores = ", ".join(names[d] if len(counts) == 1 and not full else f"{names[d]} ({c}/{n_layers} layers)"
                       for d, c in counts.items()) + (" +scales" if st.get("scales") else "")
    warn = None
    if full:
        warn = (f"'{rec.kv_dtype}' is named as quantized but stores {len(full)} of {n_layers} layers at the "
                f"model's precision ({', '.join(sorted(set(full)))})")
    kv = st["k_bytes_per_token"] + st["v_bytes_per_token"] if "k_bytes_per_token" in st else None
    return {"stores": stores, "layers": summary(st.get("kinds")), "kv_bytes_per_token": kv,
            "scale_bytes_per_token": st.get("scale_bytes_per_token"), "storage": st, "not_quantized": warn}


def _full_precision(kv_dtype: str, layer_dtypes: list[str], sizes: dict, model: str | None) -> list[str]:
    """The layers' dtypes that are the model's precision (its dtype, or as many bytes or more), when ``kv_dtype``
    is named as quantized; else []."""
    from kvdiag import dtypes

    if not dtypes.named_quantized(kv_dtype):
        return []
    model_bytes = dtypes.element_bytes(model) or 2

    def size(x: str) -> int:
        return sizes.get(x) or dtypes.element_bytes(x.removesuffix("+scales")) or 0
    return [d for d in layer_dtypes if any(x == model or size(x) >= model_bytes for x in d.split("/"))]


CHECK = Check(
    "dtypes", "kvdiag.checks.dtypes_matrix:run_case", DtypesParams, timeout=300.0,
    help="The kv dtype support matrix: does the engine start with each dtype, is the output finite, bit-identical "
    "or within drift of 'auto', and what its cache stores.",
    render="kvdiag.report.views:dtypes", plots="kvdiag.report.plots:dtypes_plots",
    cases="kvdiag.run.cases:dtypes_cases", gpu_share=True, selftest={"num_prompts": 2})
