"""The builtin engine's `kvdiag selftest` catalogue: every fault compiled into it (``faults.py``: the switches), its
bug class, the check meant to catch it, where else it runs and what it moves (``Fault.moves``: the checks that
observe none of it are n/a). What a fault and a catalogue are:
``kvdiag/engines/selftest.py``; how the checks run them: ``kvdiag/checks/selftest/``.

The builtin engine records no firing (no ``fault_state``): a fault's row says ``-`` under fired.
No torch import here: ``kvdiag selftest --list`` stays instant.
"""

from __future__ import annotations

from kvdiag.engines.selftest import L1, L2, Catalogue, Fault, items

FAULTS: tuple[Fault, ...] = (
    Fault("scale_cache_registry", "S0", "memleak", {"memleak": items("int8_per_token_head")},
          ("memory",), "per-token-head scale caches kept in a module global after shutdown", leaves_process_state=True,
          unseen={"sleep": "the scale caches are ~6% of an int8 cache: within wake-cycle's tolerance for memory freed "
                  "while asleep"}),
    Fault("explicit_bf16_rejected", "S1", "dtypes",
          {"dtypes": items("bfloat16"), "accuracy": items("bfloat16"), "memleak": items("bfloat16"),
           "wake-cycle": items(("bfloat16", L1)), "poison": items("bfloat16")},
          ("tokens",), "kv_cache_dtype='bfloat16' raises 'Unsupported data type of kv cache: bfloat16'"),
    Fault("explicit_bf16_misdispatch", "S1", "dtypes", {"dtypes": items("bfloat16"), "accuracy": items("bfloat16")},
          ("scores",), "an explicit 'bfloat16' runs the fp8 path: not bit-identical to 'auto'"),
    Fault("stale_views_after_wake", "S2", "wake-cycle", {"wake-cycle": items(("auto", L1))}, ("sleep",),
          "cache views and pointer/stride tables not rebuilt after wake"),
    Fault("fp8_scales_lost_on_wake", "S2", "wake-cycle", {"wake-cycle": items(("fp8", L2))}, ("sleep",),
          "per-tensor fp8 k/v scales come back as 0.0 after a level-2 wake"),
    Fault("unzeroed_page_reads", "S3", "poison", {"poison": items("auto")}, ("kv_blocks",),
          "fresh blocks not zeroed and attention reads whole pages (whole_page_reads + no_zero_fresh_blocks)"),
    Fault("lru_cache_bound_method", "S4", "memleak",
          {"memleak": items("int8_per_token_head"), "wake-cycle": items(("auto", L2))}, ("memory",),
          "an lru_cache keyed by the model's bound forward keeps the weights alive", leaves_process_state=True),
    Fault("gc_freeze_not_undone", "S4", "memleak", {"memleak": items("int8_per_token_head")}, ("memory",),
          "gc.freeze() at start, never undone", leaves_process_state=True,
          unseen={"sleep": "frozen objects are still freed by reference counting; only gc.get_freeze_count() after "
                  "shutdown shows the bug"}),
    Fault("global_kv_list", "S4", "memleak",
          {"memleak": items("int8_per_token_head"), "wake-cycle": items(("auto", L1))}, ("memory",),
          "the KV tensors appended to a module global on every start", leaves_process_state=True),
    Fault("per_layer_side_tensors", "S0", "memleak", {"memleak": items("auto")}, ("memory",),
          "one side tensor per layer, each under 1% of the KV cache, kept in a module global after shutdown",
          leaves_process_state=True, kinds={"memleak": ("kv_shaped_survived", "kv_scaled_survived")},
          unseen={"sleep": "the side tensors are a few % of the cache: within wake-cycle's tolerance for memory "
                  "freed while asleep"}),
    Fault("orphan_worker_process", "S4", "memleak", {"memleak": items("auto")}, ("memory",),
          "every start launches a worker process that shutdown never stops", leaves_process_state=True,
          unseen={"sleep": "the worker holds its memory whether the engine sleeps or not: sleep still frees the "
                  "engine's own"}),
    Fault("v_with_k_scales", "accuracy", "accuracy",
          {"accuracy": items("int8_per_token_head"), "dtypes": items("int8_per_token_head")}, ("scores",),
          "attention dequantizes V with K's scales (per-token-head dtypes; fp8 when k/v scales differ)"),
    Fault("prefix_hit_treated_fresh", "S5", "paths", {"paths": items(("auto", {"path": "prefix-hit"}),
                                                                     ("auto", {"path": "prefix-partial"}))},
          ("kv_paths",), "blocks reused from the prefix cache are zeroed as if fresh: a hit reads zeros"),
    Fault("evicted_block_keeps_hash", "S5", "paths", {"paths": items(("auto", {"path": "prefix-evicted"}))},
          ("kv_paths",),
          "an evicted prefix-cache block keeps its hash: a later prompt with that prefix reads another's K/V"),
    Fault("preempt_keeps_freed_blocks", "S5", "paths", {"paths": items(("auto", {"path": "preemption"}))},
          ("kv_paths",), "a preempted request keeps its freed blocks and resumes on them without recompute"),
    Fault("chunk_context_dropped", "S5", "paths", {"paths": items(("auto", {"path": "chunked-prefill"}))},
          ("kv_paths",), "a prefill chunk after the first attends only to its own tokens"),
    Fault("connector_load_layer_shifted", "S5", "paths", {"paths": items(("auto", {"path": "kv-connector"}))},
          ("kv_paths",), "the KV connector loads the first layer's K/V from the second layer's stored blocks"),
)

CATALOGUE = Catalogue("builtin", FAULTS, forked=False)
