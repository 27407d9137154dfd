"""wake-cycle's steps on one KV view, run where the cache is (``kv_where.on_kv``: in the case's process, or in each
of vLLM's worker processes on its shard). Before a sleep, ``scrub`` zeroes the free blocks (a correct engine never
reads them again); after the wake, ``mark`` keeps the cache's fingerprint in the process that holds it, and after the
regeneration ``scan_written`` scans the slots it wrote and those of blocks still held."""

from __future__ import annotations

from dataclasses import asdict

from kvdiag.checks import kv_tensors

_MARKS: dict = {}  # the fingerprint ``mark`` took in this process, for ``scan_written``


def scrub(view) -> str:
    """Zero the free blocks; the cache's device."""
    kv_tensors.fill_blocks(view, view.free_blocks(), "zero")
    return str(view.layers[0].k.device)


def mark(view) -> None:
    _MARKS["marks"] = kv_tensors.slot_fingerprint(view)


def scan_written(view) -> dict:
    """The slots whose fingerprint changed since ``mark`` and those of the blocks still held, scanned
    (``kv_tensors.SlotScan`` as a dict; the shards' dicts merge with ``SlotScan.merged``)."""
    import torch

    changed = (kv_tensors.slot_fingerprint(view) != _MARKS.pop("marks")).nonzero().flatten()
    held = kv_tensors.block_slots(view.used_blocks(), view.block_size)
    return asdict(kv_tensors.scan_slots(view, torch.unique(torch.cat([changed, held]))))
