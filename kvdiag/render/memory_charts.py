"""Line charts of memory snapshots (one per measure a run has), for the checks that measure memory."""

from __future__ import annotations

from kvdiag.render.svg import line_chart

MEASURES = (("rss_mib", "process RSS (MiB)"), ("tensor_mib", "live tensors (MiB)"),
            ("cuda_allocated_mib", "CUDA allocated (MiB)"), ("cuda_reserved_mib", "CUDA reserved (MiB)"),
            ("driver_used_mib", "device memory used, driver (MiB)"), ("nvml_process_mib", "NVML process (MiB)"))


def stage_label(s: dict) -> str:
    stage = s.get("stage", "?").removeprefix("after-")
    return stage if stage == "baseline" else f"c{s.get('cycle')} {stage}"


def memory_lines(title: str, xlabel: str, rows: dict[str, list[dict]], measures=MEASURES) -> list[str]:
    """rows: series name -> snapshots; one line chart per measure that any snapshot has."""
    xlabels = list(dict.fromkeys(stage_label(s) for snaps in rows.values() for s in snaps))
    out = []
    for key, label in measures:
        series = {}
        for name, snaps in rows.items():
            at = {stage_label(s): s.get(key) for s in snaps}
            series[name] = [at.get(x) for x in xlabels]
        if any(v is not None for vs in series.values() for v in vs):
            out.append(line_chart(f"{title}: {label}", label, xlabels, series, xlabel=xlabel))
    return out
