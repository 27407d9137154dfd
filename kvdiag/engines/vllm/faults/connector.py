"""A fault in the KV-connector path by which vLLM's KV cache reaches attention (bug class S5): K/V loaded from a
connector's store into the wrong layer. ``paths`` must catch it on ``kv-connector`` (one engine stores each prompt's
blocks through vLLM's ``ExampleConnector``, a second, in a process of its own, loads them) while the cold path, which
has no connector, stays clean.
"""

from __future__ import annotations

from kvdiag.engines.vllm.faults.patching import CodePoint, fire, wrap

LOAD = CodePoint("vllm.distributed.kv_transfer.kv_connector.v1.example_connector", "ExampleConnector.start_load_kv")
LAYER_SHIFTED = "connector_load_layer_shifted"


def cache_layers(forward_context) -> list[str]:
    """The names of the layers with a KV cache in a forward context, in vLLM's order (the layers the example
    connector loads, one file each)."""
    return [n for n, m in forward_context.no_compile_layers.items() if getattr(m, "kv_cache", None) is not None]


def connector_load_layer_shifted(kv_cache_dtype: str | None = None) -> list[str]:
    """S5, a KV connector that loads one layer's K/V from another layer's file: the first attention layer gets the
    second's stored K/V.

    Code point: ``ExampleConnector.start_load_kv(forward_context)``
    (``vllm/distributed/kv_transfer/kv_connector/v1/example_connector.py``; named ``SharedStorageConnector`` before
    vLLM #30201), where the worker side of vLLM's example connector, before a step's forward, reads each loading
    request's stored K/V, one safetensors file per layer named by ``_generate_filename_debug(layer_name, token_ids,
    ...)``, into the request's blocks of that layer. Relied on: those two methods, and
    ``forward_context.no_compile_layers`` (layer name -> module, a ``kv_cache`` on the attention layers). Versions:
    vLLM 0.32 (source read); 0.24 by those names (the connector's load through ``_generate_filename_debug`` is older
    than the rename; its 0.24 source was not read here). The fault: while the connector loads, the first cache
    layer's file name is the second's, so the loaded K/V of layer 0 is layer 1's; every other layer loads its own.
    The class of vLLM #57661 (NIXL truncated layers) and #42179 (fp8 corrupted under disaggregation): K/V that
    arrives, counted as a full hit, but not where it belongs. Fires once per loading request and step: only where a
    connector loads (never in an engine without one, nor on the storing side).

    Intended check: ``paths``, ``kv-connector`` (finding ``divergence`` or ``logprob_drift``).

    Outside kvdiag: ``apply(["connector_load_layer_shifted"])`` before ``vllm.LLM(..., kv_transfer_config=
    {"kv_connector": "ExampleConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"shared_storage_path":
    DIR}})`` in the loading process; a first process with the same arguments stores the prompts
    (``tests/support/vllm_connector_probe.py``).
    """
    def make(original):
        def start_load_kv(self, forward_context, *args, **kwargs):
            layers = cache_layers(forward_context)
            if len(layers) < 2:
                return original(self, forward_context, *args, **kwargs)
            own, swap = self._generate_filename_debug, {layers[0]: layers[1]}

            def shifted(layer_name, *a, **k):
                if layer_name in swap:
                    fire(LAYER_SHIFTED)
                return own(swap.get(layer_name, layer_name), *a, **k)

            self._generate_filename_debug = shifted  # this call only: the storing side names its files right
            try:
                return original(self, forward_context, *args, **kwargs)
            finally:
                del self._generate_filename_debug
        return start_load_kv
    wrap(LOAD, LAYER_SHIFTED, make)
    return [str(LOAD)]
