"""The paths the ``paths`` check holds to the cold path: each a way the KV cache reaches attention other than one
cold prefill then decode. Engine-neutral: how an engine takes a path is its traits' ``path_config``
(``kvdiag/engines/traits.py``); what the worker runs for each is ``run.py``; the counter that shows the path was
taken is ``counter`` (``engine.path_counters()``).

A path that spans GPUs (``SPAN``) gets them from the scheduler: its engine arguments are set before any worker
starts (``params.spread``), or the case is ``unsupported`` there, with the reason, where fewer GPUs are visible.

``reference``: the cold path it is held to. None: the path runs in the engine of its own cold runs (a prefix-cache
hit and a miss in one cache). Else the name of a reference case of the same kv dtype, run in a worker of its own
(an engine that captures CUDA graphs cannot start again in its process: docs/vllm-findings.md, 16): ``cold`` is the
engine as the user configured it, ``cold-nographs`` the same without CUDA graphs (vLLM: compiled, cudagraph_mode
NONE; compiling alone moves logprobs, so graphs are held to a compiled engine, not an eager one).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Path:
    name: str
    summary: str  # one line for --help and the tables
    counter: str | None  # path_counters() key that must grow on the path (None: none is counted)
    reference: str | None = "cold"  # the reference case it is held to; None: its own engine's cold runs
    own_floor: bool = False  # every run of it takes the path, whatever the batch (graphs, chunks, drafts): its engine
    # runs the floor's batches too, each held to the reference's same batch (layouts.py); not preemption, which
    # smaller batches do not take (their difference is the path's)


PATHS: dict[str, Path] = {p.name: p for p in (
    Path("prefix-hit", "the same prompts again: their full blocks read back from the prefix cache",
         "prefix_hit_tokens", None),
    Path("prefix-partial", "prompts sharing a leading part that ends inside a block: the full blocks hit, the rest "
         "is computed", "prefix_hit_tokens", None),
    Path("prefix-reset", "the same prompts after reset_prefix_cache: cold again, nothing read from the cache",
         "prefix_hit_tokens", None),
    Path("prefix-evicted", "a pool that holds the prompts, then other prompts that evict part of their cached "
         "blocks, then the prompts again: what is still cached hits, the rest is computed", "evicted_blocks", None),
    Path("preemption", "a KV pool too small for every request at its longest: requests are preempted and "
         "recomputed", "preemptions"),
    Path("chunked-prefill", "prompts prefilled in small chunks instead of whole", "prefill_chunks", own_floor=True),
    Path("cudagraph-piecewise", "CUDA graphs around attention (piecewise) against none", None, "cold-nographs",
         own_floor=True),
    Path("cudagraph-full", "full CUDA graphs, attention inside, against none", None, "cold-nographs",
         own_floor=True),
    Path("spec-ngram", "speculative decoding with ngram proposals (no draft model) against none",
         "spec_draft_tokens", own_floor=True),
    Path("offload", "the KV cache stored to CPU memory, dropped from the device and loaded back (after the reset, "
         "tokens read as cached came from the CPU tier)", "prefix_hit_tokens"),
    Path("kv-connector", "the KV cache stored through a KV connector by one engine and loaded by a second, in a "
         "process of its own (vLLM: ExampleConnector, files on disk): the second's outputs against cold",
         "connector_loaded_tokens"),
    Path("tensor-parallel", "the engine spread over 2 GPUs (tensor parallel) against one: every run takes it",
         None, own_floor=True),
    Path("sliding-window", "a generation past a sliding layer's window (its blocks freed and reused) against a "
         "prefill of the same tokens; cuts inside the window are its floor", "window_freed_blocks", None),
)}

# named with -p only: two engine starts per kv dtype, one in a process of its own, would about double the default
# run's time (issue 67, item 5: within 2x of the default set's time, or a named option)
OPTIONAL = ("kv-connector",)
DEFAULT = tuple(p for p in PATHS if p not in OPTIONAL)
SPAN = {"tensor-parallel": 2}  # GPUs a path's engine spans
REFERENCES = {"cold": "the engine as configured, cold: the reference of the paths that run in an engine of their own",
              "cold-nographs": "the engine without CUDA graphs, cold: the reference of the CUDA-graph paths"}
