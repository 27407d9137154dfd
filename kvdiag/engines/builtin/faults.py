"""Bugs the builtin engine can re-introduce on purpose, so kvdiag's checks can be shown to catch them.

Enabled by ``EngineSpec.faults`` (names below; ``--fault`` on the command line); all are off by
default. ``kvdiag selftest`` runs each through the checks (the catalogue, with each fault's bug class
and intended check, is ``kvdiag/engines/builtin/selftest.py``).

Wrong results (bug class S1 and accuracy):

- ``explicit_bf16_rejected`` (S1): starting with ``kv_cache_dtype="bfloat16"`` raises
  ``ValueError("Unsupported data type of kv cache: bfloat16")`` although ``auto`` (the same
  storage on a bf16 model) works.
- ``explicit_bf16_misdispatch`` (S1): an explicit ``bfloat16`` falls through to the fp8 branch:
  K/V are stored as float8_e4m3 (scale 1.0) while ``auto`` stores bf16; it runs, but is not
  bit-identical to ``auto``.
- ``v_with_k_scales``: attention dequantizes V with K's scales (the per-tensor ``k_scale``,
  and K's per-(token, head) scale cache for the per-token-head dtypes). Visible wherever the
  two differ: always for the per-token-head dtypes; for fp8 only with a checkpoint whose
  ``k_scale`` and ``v_scale`` differ (the shipped model has none: both 1.0).

KV state across sleep/wake and fresh blocks (S2, S3):

- ``stale_views_after_wake`` (S2): the per-layer cache views and the pointer/stride
  tables attention reads through are neither dropped at sleep nor rebuilt at wake:
  attention keeps reading the old tensors while new K/V is written to the new ones.
- ``fp8_scales_lost_on_wake`` (S2): after a level-2 wake the per-tensor fp8 ``k_scale``/
  ``v_scale`` come back as 0.0 instead of the checkpoint's values (or 1.0).
- ``whole_page_reads`` (S3): attention reads every slot of a sequence's last block,
  masking scores with -inf but multiplying V there by weight 0 (NaN propagates).
- ``no_zero_fresh_blocks`` (S3): freshly allocated blocks are not zeroed.
  Each S3 half alone is harmless; ``unzeroed_page_reads`` (an alias) switches on both: the bug.

KV paths (the paths check): each breaks one path that must give what the cold path (no prefix cache, whole
prefill, no preemption) gives; ``engine.fault_fired`` counts how often each fired since ``start``:

- ``prefix_hit_treated_fresh``: blocks reused from the prefix cache are handed to the fresh-block
  hook (zeroed) as if new, so a hit reads zeros where the cached prefix was. Fires on every hit.
- ``evicted_block_keeps_hash``: a cached block evicted to be handed out again keeps its hash in the prefix cache's
  lookup, so a later request with the evicted prefix "hits" it and reads what the block's new owner wrote there
  (vLLM #44237: always reset a block's hash on reuse). Fires on every eviction: only a pool under pressure evicts
  (``prefix-evicted``).
- ``preempt_keeps_freed_blocks``: a preempted request's blocks go back to the free pool but it keeps
  its block table and is not recomputed when resumed: it goes on decoding on blocks other requests may
  have been given and overwritten (vLLM #52360). Fires on every preemption (``-a preemption=1``).
- ``chunk_context_dropped``: a prefill chunk after the first gets an attention sequence length that
  counts the chunk's own tokens only (positions and K/V writes stay right), so it does not attend over
  the chunks before it (the kernel reads that many positions from the sequence's start). Fires on every
  chunk after the first (``-a enable_chunked_prefill=1``).
- ``connector_load_layer_shifted``: the KV connector (``-a kv_connector_dir``, ``connector.py``) loads the first
  layer's K/V from the second layer's stored blocks, so a prompt loaded from another engine's store reads another
  layer's K/V in layer 0 (the class of vLLM #57661, NIXL truncated layers). Fires on every load (``kv-connector``).

Memory held after shutdown (S0, S4: ``memleak``), applied by :meth:`Faults.on_start`:

- ``lru_cache_bound_method``: a module-level ``functools.lru_cache`` is called with the
  model's bound ``forward``; the cache keeps the model (weights) alive after shutdown.
- ``gc_freeze_not_undone``: ``gc.freeze()`` at the end of start, no ``gc.unfreeze()`` at shutdown.
- ``scale_cache_registry`` (S0): the per-token-head scale caches (int8/fp8_per_token_head only)
  are kept in a module-level registry after shutdown.
- ``global_kv_list``: the KV tensors are appended to a module-level list on every start.
- ``per_layer_side_tensors`` (S0's shape, split): every start keeps one float32 tensor per layer,
  ``[num_blocks, block_size, num_kv_heads, 2]`` (a K and V amax per token and head), in a module-level dict,
  replacing the previous start's: each is well under 1% of the KV cache (1/(32 x layers) of a bf16 cache with
  64-wide heads), together over it; the same every cycle, as a process-lifetime cache would be.
- ``orphan_worker_process``: every start launches a worker process holding memory (256 MiB of GPU memory on
  CUDA, 64 MiB of RAM on the CPU), as an engine that spans GPUs does, and shutdown never stops it (it ends
  with its parent).
"""

from __future__ import annotations

import functools
import gc
from dataclasses import dataclass, fields

from kvdiag.errors import UserError

ALIASES = {"unzeroed_page_reads": ("whole_page_reads", "no_zero_fresh_blocks")}
PATH_FAULTS = ("prefix_hit_treated_fresh", "evicted_block_keeps_hash", "preempt_keeps_freed_blocks",
               "chunk_context_dropped", "connector_load_layer_shifted")


UNSUPPORTED_BF16 = "Unsupported data type of kv cache: bfloat16"


@dataclass(frozen=True)
class Faults:
    explicit_bf16_rejected: bool = False
    explicit_bf16_misdispatch: bool = False
    v_with_k_scales: bool = False
    stale_views_after_wake: bool = False
    fp8_scales_lost_on_wake: bool = False
    whole_page_reads: bool = False
    no_zero_fresh_blocks: bool = False
    lru_cache_bound_method: bool = False
    gc_freeze_not_undone: bool = False
    scale_cache_registry: bool = False
    global_kv_list: bool = False
    per_layer_side_tensors: bool = False
    orphan_worker_process: bool = False
    prefix_hit_treated_fresh: bool = False
    evicted_block_keeps_hash: bool = False
    preempt_keeps_freed_blocks: bool = False
    chunk_context_dropped: bool = False
    connector_load_layer_shifted: bool = False

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def expand(cls, names) -> list[str]:
        """Normalise names and expand aliases (``unzeroed_page_reads`` = both S3 switches)."""
        names = [n.strip().lower().replace("-", "_") for n in (names or ()) if n.strip()]
        return [f for n in names for f in ALIASES.get(n, (n,))]

    @classmethod
    def parse(cls, names) -> "Faults":
        names = cls.expand(names)
        unknown = [n for n in names if n not in cls.names()]
        if unknown:
            raise UserError(f"unknown builtin fault(s) {', '.join(unknown)}; valid: {', '.join(cls.names())}")
        return cls(**{n: True for n in names})

    @property
    def enabled(self) -> tuple[str, ...]:
        return tuple(n for n in self.names() if getattr(self, n))

    def __contains__(self, name: str) -> bool:
        return bool(getattr(self, name, False))

    def check_kv_dtype(self, kv_dtype: str) -> None:
        """explicit_bf16_rejected: the start-time dtype check that does not know 'bfloat16'."""
        if self.explicit_bf16_rejected and kv_dtype == "bfloat16":
            raise ValueError(UNSUPPORTED_BF16)

    def kv_path(self, kv_dtype: str) -> str:
        """The dtype whose cache and kernels actually run (explicit_bf16_misdispatch: 'bfloat16' -> fp8)."""
        return "fp8" if self.explicit_bf16_misdispatch and kv_dtype == "bfloat16" else kv_dtype

    def on_start(self, engine) -> None:
        """The memleak faults, applied once the engine has started (the model and KV cache exist)."""
        if self.lru_cache_bound_method:
            _compiled_forward(engine.model.forward)
        layers = engine.kv.layers if engine.kv is not None else []
        if self.scale_cache_registry:
            _SCALE_CACHES.extend(t for l in layers for t in (l.k_scale, l.v_scale) if t is not None)
        if self.global_kv_list:
            _KV_TENSORS.append([(l.k, l.v) for l in layers])
        if self.per_layer_side_tensors:
            _side_tensors(engine.kv)
        if self.gc_freeze_not_undone:
            gc.freeze()
        if self.orphan_worker_process:
            _ORPHANS.append(_start_orphan(engine.device.type == "cuda"))


_SCALE_CACHES: list = []  # scale_cache_registry: per-token-head scale caches, never released
_KV_TENSORS: list = []  # global_kv_list: the KV tensors of every start
_SIDE_TENSORS: dict = {}  # per_layer_side_tensors: one tensor per layer, replaced every start
_ORPHANS: list = []  # orphan_worker_process: the worker processes of every start, never stopped
ORPHAN_MIB = {"cuda": 256, "cpu": 64}
_ORPHAN = """import os, sys, time
parent, device, n = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]) << 20
if device == "cuda":
    import torch
    held = torch.ones(n, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
else:
    held = bytearray(b"x" * n)
print("ready", flush=True)
while os.getppid() == parent:
    time.sleep(0.2)
"""


def _start_orphan(cuda: bool):
    """orphan_worker_process: a process that holds memory until its parent ends; returns once it holds it."""
    import os
    import subprocess
    import sys

    device = "cuda" if cuda else "cpu"
    proc = subprocess.Popen([sys.executable, "-c", _ORPHAN, str(os.getpid()), device, str(ORPHAN_MIB[device])],
                            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    proc.stdout.readline()
    return proc


def _side_tensors(kv) -> None:
    """per_layer_side_tensors: the previous start's go first, so the same sizes survive every shutdown."""
    import torch

    _SIDE_TENSORS.clear()
    for i in range(kv.num_layers if kv is not None else 0):
        _SIDE_TENSORS[i] = torch.zeros(kv.num_blocks, kv.block_size, kv.num_kv_heads, 2, dtype=torch.float32,
                                       device=kv.device)


@functools.lru_cache(maxsize=None)
def _compiled_forward(forward):
    """lru_cache_bound_method: a cache keyed by a bound method keeps its object (the model) alive."""
    return forward
