"""The builtin engine's KV connector (``-a kv_connector_dir=DIR``), as vLLM's example connector moves K/V between
engines: a request whose prefill an engine computed has its prompt's full blocks (all but its last token, as a
prefix-cache hit) saved to one file in DIR, named by a hash of those tokens; an engine admitting a prompt whose file
is there loads those blocks into its own and prefills only the rest. Any engine of the same model and kv dtype can
load what another saved: the ``paths`` check's ``kv-connector`` path starts the second in a process of its own.

Fault ``connector_load_layer_shifted``: the first layer's K/V is loaded from the second layer's stored blocks.
"""

from __future__ import annotations

import hashlib
import os

import torch

PARTS = ("k", "v", "k_scale", "v_scale")  # per layer; the scale caches of the per-token-head dtypes, else None


class Connector:
    def __init__(self, directory: str, kv, shifted: bool):
        self.directory, self.kv, self.shifted = directory, kv, shifted
        self.bs = kv.block_size

    def _file(self, tokens, blocks: int) -> str:
        key = hashlib.sha256(",".join(map(str, tokens[:blocks * self.bs])).encode()).hexdigest()[:32]
        return os.path.join(self.directory, f"{key}.pt")

    def full_blocks(self, tokens) -> int:
        """The blocks of a prompt the connector keeps: its full ones, its last token left to compute."""
        return (len(tokens) - 1) // self.bs

    def loadable(self, tokens) -> int:
        """How many leading blocks of ``tokens`` are stored (0: none)."""
        n = self.full_blocks(tokens)
        return n if n and os.path.exists(self._file(tokens, n)) else 0

    def save(self, tokens, table: list[int]) -> None:
        """Save the prompt's full blocks of every layer (once: an existing file is kept), written whole before it is
        named (another engine may look for it at any time)."""
        n = self.full_blocks(tokens)
        path = self._file(tokens, n)
        if not n or os.path.exists(path):
            return
        ids = torch.tensor(table[:n], device=self.kv.device)
        data = {p: [None if getattr(l, p) is None else getattr(l, p)[ids].cpu() for l in self.kv.layers]
                for p in PARTS}
        os.makedirs(self.directory, exist_ok=True)
        torch.save(data, path + ".part")
        os.replace(path + ".part", path)

    def load(self, tokens, table: list[int], first: int, n: int) -> bool:
        """Blocks ``first`` to ``n - 1`` of the stored prompt into the request's blocks of every layer; True when the
        fault moved a layer."""
        data = torch.load(self._file(tokens, n), map_location=self.kv.device)
        ids = torch.tensor(table[first:n], device=self.kv.device)
        moved = self.shifted and len(self.kv.layers) > 1
        for i, layer in enumerate(self.kv.layers):
            src = 1 if moved and i == 0 else i
            for p in PARTS:
                if getattr(layer, p) is not None:
                    getattr(layer, p)[ids] = data[p][src][first:n]
        return moved
