"""The builtin engine's `kvdiag selftest` catalogue: every fault compiled into it (``faults.py``: the switches), its
bug class, the check meant to catch it and where else it runs. What a fault and a catalogue are:
``kvdiag/engines/selftest.py``; how the checks run them: ``kvdiag/checks/selftest/``.

The builtin engine records no firing (no ``fault_state``): a fault's row says ``-`` under fired.
No torch import here: ``kvdiag selftest --list`` stays instant.
"""

from __future__ import annotations

from kvdiag.engines.selftest import (
    L1,
    L2,
    MEMORY_ONLY,
    NEVER_SLEEPS,
    NO_MEMORY,
    NO_POISON,
    ONE_PATH,
    SELF_COMPARE,
    Catalogue,
    Fault,
    items,
    na_for,
)

FAULTS: tuple[Fault, ...] = (
    Fault("scale_cache_registry", "S0", "memleak", {"memleak": items("int8_per_token_head")},
          na_for({"*": NO_MEMORY, "wake-cycle": "the scale caches are ~6% of an int8 cache: within wake-cycle's "
                  "tolerance for memory freed while asleep"}, "accuracy", "dtypes", "wake-cycle", "poison", "paths"),
          "per-token-head scale caches kept in a module global after shutdown", leaves_process_state=True),
    Fault("explicit_bf16_rejected", "S1", "dtypes",
          {"dtypes": items("bfloat16"), "accuracy": items("bfloat16"), "memleak": items("bfloat16"),
           "wake-cycle": items(("bfloat16", L1)), "poison": items("bfloat16")},
          {}, "kv_cache_dtype='bfloat16' raises 'Unsupported data type of kv cache: bfloat16'"),
    Fault("explicit_bf16_misdispatch", "S1", "dtypes", {"dtypes": items("bfloat16"), "accuracy": items("bfloat16")},
          na_for({"*": SELF_COMPARE, "memleak": MEMORY_ONLY}, "memleak", "wake-cycle", "poison", "paths"),
          "an explicit 'bfloat16' runs the fp8 path: not bit-identical to 'auto'"),
    Fault("stale_views_after_wake", "S2", "wake-cycle", {"wake-cycle": items(("auto", L1))},
          na_for({"*": NEVER_SLEEPS}, "accuracy", "dtypes", "memleak", "poison", "paths"),
          "cache views and pointer/stride tables not rebuilt after wake"),
    Fault("fp8_scales_lost_on_wake", "S2", "wake-cycle", {"wake-cycle": items(("fp8", L2))},
          na_for({"*": NEVER_SLEEPS}, "accuracy", "dtypes", "memleak", "poison", "paths"),
          "per-tensor fp8 k/v scales come back as 0.0 after a level-2 wake"),
    Fault("unzeroed_page_reads", "S3", "poison", {"poison": items("auto")},
          na_for({"*": NO_POISON}, "accuracy", "dtypes", "memleak", "wake-cycle", "paths"),
          "fresh blocks not zeroed and attention reads whole pages (whole_page_reads + no_zero_fresh_blocks)"),
    Fault("lru_cache_bound_method", "S4", "memleak",
          {"memleak": items("int8_per_token_head"), "wake-cycle": items(("auto", L2))},
          na_for({"*": NO_MEMORY}, "accuracy", "dtypes", "poison", "paths"),
          "an lru_cache keyed by the model's bound forward keeps the weights alive", leaves_process_state=True),
    Fault("gc_freeze_not_undone", "S4", "memleak", {"memleak": items("int8_per_token_head")},
          na_for({"*": NO_MEMORY, "wake-cycle": "frozen objects are still freed by reference counting; only "
                  "gc.get_freeze_count() after shutdown shows the bug"}, "accuracy", "dtypes", "wake-cycle", "poison",
                 "paths"),
          "gc.freeze() at start, never undone", leaves_process_state=True),
    Fault("global_kv_list", "S4", "memleak",
          {"memleak": items("int8_per_token_head"), "wake-cycle": items(("auto", L1))},
          na_for({"*": NO_MEMORY}, "accuracy", "dtypes", "poison", "paths"),
          "the KV tensors appended to a module global on every start", leaves_process_state=True),
    Fault("orphan_worker_process", "S4", "memleak", {"memleak": items("auto")},
          na_for({"*": NO_MEMORY, "wake-cycle": "the worker holds its memory whether the engine sleeps or not: sleep "
                  "still frees the engine's own"}, "accuracy", "dtypes", "wake-cycle", "poison", "paths"),
          "every start launches a worker process that shutdown never stops", leaves_process_state=True),
    Fault("v_with_k_scales", "accuracy", "accuracy",
          {"accuracy": items("int8_per_token_head"), "dtypes": items("int8_per_token_head")},
          na_for({"*": SELF_COMPARE, "memleak": MEMORY_ONLY}, "memleak", "wake-cycle", "poison", "paths"),
          "attention dequantizes V with K's scales (per-token-head dtypes; fp8 when k/v scales differ)"),
    Fault("prefix_hit_treated_fresh", "S5", "paths", {"paths": items(("auto", {"path": "prefix-hit"}),
                                                                     ("auto", {"path": "prefix-partial"}))},
          na_for({"*": ONE_PATH}, "accuracy", "dtypes", "wake-cycle", "poison", "memleak"),
          "blocks reused from the prefix cache are zeroed as if fresh: a hit reads zeros"),
    Fault("evicted_block_keeps_hash", "S5", "paths", {"paths": items(("auto", {"path": "prefix-evicted"}))},
          na_for({"*": ONE_PATH}, "accuracy", "dtypes", "wake-cycle", "poison", "memleak"),
          "an evicted prefix-cache block keeps its hash: a later prompt with that prefix reads another's K/V"),
    Fault("preempt_keeps_freed_blocks", "S5", "paths", {"paths": items(("auto", {"path": "preemption"}))},
          na_for({"*": ONE_PATH}, "accuracy", "dtypes", "wake-cycle", "poison", "memleak"),
          "a preempted request keeps its freed blocks and resumes on them without recompute"),
    Fault("chunk_context_dropped", "S5", "paths", {"paths": items(("auto", {"path": "chunked-prefill"}))},
          na_for({"*": ONE_PATH}, "accuracy", "dtypes", "wake-cycle", "poison", "memleak"),
          "a prefill chunk after the first attends only to its own tokens"),
)

CATALOGUE = Catalogue("builtin", FAULTS)
