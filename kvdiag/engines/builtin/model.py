"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) whose attention goes through the paged KV cache.

Numerics follow transformers' modeling code (RMSNorm in float32, rotary cos/sin in
float32 cast to the model dtype, residual adds in the model dtype), so a float32 model
matches ``AutoModelForCausalLM`` to float32 tolerance. Q/K/V and gate/up projections
are packed into one matmul each (nano-vllm); the loader fills the packed weights.
Tokens of all sequences are packed: every tensor is [num_tokens, ...].
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from kvdiag.engines.builtin.config import ModelConfig

_HALF = (torch.bfloat16, torch.float16)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``; on CPU, half-precision operands are multiplied in float32 and the result rounded once
    to their dtype (what a half GEMM with float32 accumulation gives, ~5x faster than CPU half GEMMs)."""
    if x.device.type != "cpu" or x.dtype not in _HALF:
        return F.linear(x, weight, bias)
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)


class Linear(nn.Linear):
    def reset_parameters(self) -> None:
        """No random init: the loader fills every weight (and a random init on the meta device imports torch's
        compiler stack, ~2.5 s)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class Embedding(nn.Embedding):
    def reset_parameters(self) -> None:
        """No random init, as :meth:`Linear.reset_parameters`."""


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def inv_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """Rotary inverse frequencies for rope types default, linear and llama3 (transformers' formulas)."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rope = cfg.rope_scaling
    kind = rope.get("rope_type", "default")
    if kind == "linear":
        inv_freq = inv_freq / rope["factor"]
    elif kind == "llama3":
        factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
        old_len = rope["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Rotary(nn.Module):
    """cos/sin tables [max_len, head_dim] in float32, filled by :meth:`build` (a derived table)."""

    def __init__(self, cfg: ModelConfig, max_len: int):
        super().__init__()
        self.cfg, self.max_len = cfg, max_len
        self.register_buffer("cos", torch.empty(max_len, cfg.head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_len, cfg.head_dim), persistent=False)

    @torch.no_grad()
    def build(self) -> None:
        device = self.cos.device
        freqs = torch.arange(self.max_len, device=device).float()[:, None] * inv_frequencies(self.cfg).to(device)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos, self.sin = emb.cos(), emb.sin()

    def at(self, positions, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of ``positions`` in ``dtype``, [num_tokens, 1, head_dim]: gathered once per forward, not
        once per layer."""
        return self.cos[positions].to(dtype).unsqueeze(1), self.sin[positions].to(dtype).unsqueeze(1)

    @staticmethod
    def apply(cos_sin, q, k):
        cos, sin = cos_sin
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype):
        super().__init__()
        self.layer = layer
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias, dtype=dtype)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias, dtype=dtype)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype)

    def forward(self, cos_sin, x, kv, meta, rows=None):
        """``cos_sin``: :meth:`Rotary.at` of the tokens' positions; ``kv`` is the engine's KVCache, ``meta`` the
        batch's AttnMetadata (kv_cache.py).
        ``rows`` (Rows): every token's K/V is stored, but only these rows attend and come out."""
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(n, self.heads, self.head_dim)
        k = k.reshape(n, self.kv_heads, self.head_dim)
        v = v.reshape(n, self.kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = Rotary.apply(cos_sin, q, k)
        kv.store(self.layer, k, v, meta)
        if rows is not None:
            q, meta = q[rows.index], rows.meta
        out = kv.attend(self.layer, q, meta, self.scale)
        return self.o_proj(out.reshape(q.shape[0], self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias, dtype=dtype)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias, dtype=dtype)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype):
        super().__init__()
        self.self_attn = Attention(cfg, layer, dtype)
        self.mlp = MLP(cfg, dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, cos_sin, x, kv, meta, rows=None):
        h = self.self_attn(cos_sin, self.input_layernorm(x), kv, meta, rows)
        x = (x if rows is None else x[rows.index]) + h
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, dtype) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)


@dataclass
class Rows:
    """A subset of a packed batch's tokens: the last k_s tokens of each sequence s, ``index`` into the batch's
    rows and ``meta`` the AttnMetadata of those tokens as queries (same sequences, lengths and tables)."""

    index: torch.Tensor
    meta: object

    @classmethod
    def last_of_each(cls, meta) -> "Rows":
        """The last token of each sequence (what prefill needs for next-token logits)."""
        index = meta.query_start_loc[1:].long() - 1
        qsl = torch.arange(index.numel() + 1, dtype=meta.query_start_loc.dtype, device=index.device)
        return cls(index, replace(meta, slot_mapping=meta.slot_mapping[index], query_start_loc=qsl))


class CausalLM(nn.Module):
    """Parameter names match the checkpoint's, except the packed ``qkv_proj``/``gate_up_proj``."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, max_len: int):
        super().__init__()
        self.cfg = cfg
        self.model = DecoderModel(cfg, dtype)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, bias=False,
                                                                      dtype=dtype)
        self.rotary = Rotary(cfg, max_len)

    @torch.inference_mode()
    def forward(self, input_ids, positions, kv, meta, rows: Rows | None = None) -> torch.Tensor:
        """Final hidden states [num_tokens, hidden_size] of the packed batch; with ``rows``, of those rows
        only (the last layer computes its attention output and MLP for them alone)."""
        x = self.model.embed_tokens(input_ids)
        cos_sin = self.rotary.at(positions, x.dtype)
        last = len(self.model.layers) - 1
        for i, layer in enumerate(self.model.layers):
            x = layer(cos_sin, x, kv, meta, rows if i == last else None)
        return self.model.norm(x)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return linear(hidden, weight)
