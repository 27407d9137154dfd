"""wake-cycle's scan of a KV cache split over worker processes (tensor parallelism): each process scans its shard,
and the case's scan is their sum, the first bad slot any of them found (kv_tensors.SlotScan.merged,
poison's too)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


def test_the_shards_scans_sum_to_the_whole_cache_and_keep_the_first_bad_slot():
    from dataclasses import asdict

    from kvdiag.checks.kv_tensors import SlotScan

    merged = SlotScan.merged

    clean = SlotScan(slots=40)
    bad = SlotScan(slots=40, nonfinite=3, bad_scales=1, first={"tensor": "k", "block": 7, "offset": 2})
    whole = merged([asdict(clean), asdict(bad)])
    assert (whole.slots, whole.nonfinite, whole.bad_scales) == (80, 3, 1)
    assert whole.first == {"tensor": "k", "block": 7, "offset": 2} and not whole.ok
    assert merged([asdict(clean), asdict(clean)]).ok and merged([]).slots == 0


def test_the_steps_on_one_view_find_what_the_regeneration_wrote_and_nothing_else():
    """On the builtin engine's real cache: after ``mark``, a write of NaN into one held slot is found by
    ``scan_written``; a scrubbed free block is all zeros."""
    from kvdiag.assets import TINY_MODEL
    from kvdiag.checks.wake_cycle import kv_steps
    from kvdiag.engines.base import EngineSpec, create_engine

    engine = create_engine("builtin")
    engine.start(EngineSpec(model=str(TINY_MODEL), device="cpu", num_blocks=32, block_size=16))
    try:
        view = engine.kv_blocks()
        assert kv_steps.scrub(view) == "cpu"
        free = view.free_blocks()
        assert all(float(layer.k[b].abs().sum()) == 0 for layer in view.layers for b in free)
        kv_steps.mark(view)
        assert kv_steps.scan_written(view)["slots"] == 0  # nothing written, nothing held
        kv_steps.mark(view)
        view.layers[0].k[free[0], 3] = float("nan")  # a write the "regeneration" made
        scan = kv_steps.scan_written(view)
        assert (scan["slots"], scan["nonfinite"]) == (1, 1) and scan["first"]["block"] == free[0], scan
    finally:
        engine.shutdown()
