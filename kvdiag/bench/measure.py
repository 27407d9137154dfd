"""`kvdiag bench`'s measuring tools: timing, the copy bandwidth, a row, random paged batches and the SDPA baseline.

All numbers of a report come from one run on one device: the copy bandwidth (bytes read +
written), then per kernel x dtype x size the Triton time, achieved GB/s (bytes read +
written; attention counts the KV and scale bytes it must read), the ratio to the copy,
and each baseline's time and how many times slower it is. Times are medians of
``triton.testing.do_bench`` (L2 flushed between runs); inputs are random, never zeros.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from kvdiag.dtypes import BUILTIN_DTYPES


@dataclass
class Row:
    kernel: str  # store | decode | prefill | zero
    kv_dtype: str
    size: str
    ms: float
    gbps: float
    vs_copy: float
    baselines: dict[str, dict] = field(default_factory=dict)  # name -> {"ms", "speedup"} (baseline ms / ours)
    extra: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)


def time_ms(fn) -> float:
    """Median milliseconds of ``fn()``: ``triton.testing.do_bench`` on CUDA, a few host-timed runs elsewhere
    (CPU runs only check the plumbing)."""
    import time

    import triton.testing

    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    times = []
    for _ in range(3):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return sorted(times)[1]


def copy_gbps(device, nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth, counting bytes read plus bytes written."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    gbps = 2 * nbytes / time_ms(lambda: dst.copy_(src)) / 1e6  # noqa: F821 - deleted only after the timing
    del src, dst
    return gbps


def row(kernel, kv_dtype, size, fns: dict, nbytes: int, copy: float, extra=None) -> Row:
    """Time ``fns["triton"]`` and every other entry of ``fns`` (a baseline)."""
    ms = time_ms(fns["triton"])
    base = {}
    for name, fn in fns.items():
        if name != "triton":
            b = time_ms(fn)
            base[name] = {"ms": b, "speedup": b / ms}
    gbps = nbytes / ms / 1e6
    return Row(kernel, kv_dtype, size, ms, gbps, gbps / copy, base, extra or {})


def random_codes(shape, kv_dtype: str, model_dtype, device) -> torch.Tensor:
    """Random cache contents in the dtype's storage (int8: codes in [-127, 127])."""
    storage = BUILTIN_DTYPES[kv_dtype].torch_dtype(model_dtype)
    if storage == torch.int8:
        return torch.randint(-127, 128, shape, dtype=torch.int8, device=device)
    return (torch.randn(shape, device=device) * 4).to(storage)


@dataclass
class PagedBatch:
    """A ragged batch over a randomly filled paged cache with scattered block tables."""

    query: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    scale: float
    kv_dtype: str
    k_scale: object
    v_scale: object
    k_scale_cache: torch.Tensor | None
    v_scale_cache: torch.Tensor | None

    def args(self) -> tuple:
        return (self.query, self.k_cache, self.v_cache, self.query_start_loc, self.seq_lens, self.block_tables,
                self.scale, self.kv_dtype, self.k_scale, self.v_scale, self.k_scale_cache, self.v_scale_cache)

    def used_slots(self) -> torch.Tensor:
        """Boolean [num_blocks, block_size]: the slots some sequence's positions < seq_len occupy."""
        bs = self.k_cache.shape[1]
        used = torch.zeros(self.k_cache.shape[:2], dtype=torch.bool, device=self.k_cache.device)
        for s, n in enumerate(self.seq_lens.tolist()):
            pos = torch.arange(n, device=used.device)
            used[self.block_tables[s, pos // bs].long(), pos % bs] = True
        return used


def paged_batch(kv_dtype, q_lens, seq_lens, heads=4, kv_heads=2, head_size=16, block_size=4,
                model_dtype=torch.float32, device="cpu", spare_blocks=3, seed=0) -> PagedBatch:
    torch.manual_seed(seed)
    d = BUILTIN_DTYPES[kv_dtype]
    need = [-(-n // block_size) for n in seq_lens]
    nb = sum(need) + spare_blocks
    shape = (nb, block_size, kv_heads, head_size)
    k_cache, v_cache = (random_codes(shape, kv_dtype, model_dtype, device) for _ in range(2))
    ksc = vsc = None
    if d.quant == "per_token_head":
        ksc, vsc = ((torch.rand(shape[:3], device=device) + 0.05) * 0.05 for _ in range(2))
    perm = torch.randperm(nb, device=device)
    tables = torch.zeros(len(seq_lens), max(need) + 1, dtype=torch.int32, device=device)
    start = 0
    for s, n in enumerate(need):
        tables[s, :n] = perm[start:start + n]
        start += n
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    query = torch.randn(sum(q_lens), heads, head_size, device=device).to(model_dtype)
    per_tensor = [torch.tensor(v, device=device) for v in (0.8, 1.3)] if d.quant == "per_tensor" else [1.0, 1.0]
    return PagedBatch(query, k_cache, v_cache, qsl, torch.tensor(seq_lens, dtype=torch.int32, device=device),
                      tables, head_size ** -0.5, kv_dtype, *per_tensor, ksc, vsc)


def kv_bytes(b: PagedBatch) -> int:
    """KV (and scale) bytes attention must read: each used position's K and V rows once."""
    n = int(b.seq_lens.sum())
    kvh, hd = b.k_cache.shape[2], b.k_cache.shape[3]
    per_pos = kvh * hd * b.k_cache.element_size() + (kvh * 4 if b.k_scale_cache is not None else 0)
    return 2 * n * per_pos


def gather_dequant(b: PagedBatch, length: int, model_dtype):
    """K and V of every sequence as dense [seqs, kv_heads, length, head_size] tensors in the model dtype."""
    tables = b.block_tables.long()

    def dense(cache, sc, scale):
        x = cache[tables].flatten(1, 2)[:, :length].to(model_dtype)
        if sc is not None:
            x = x * sc[tables].flatten(1, 2)[:, :length, :, None].to(model_dtype)
        elif BUILTIN_DTYPES[b.kv_dtype].quant == "per_tensor":
            x = x * scale.to(model_dtype)
        return x.transpose(1, 2)

    return dense(b.k_cache, b.k_scale_cache, b.k_scale), dense(b.v_cache, b.v_scale_cache, b.v_scale)


def sdpa_over_gather(b: PagedBatch, q_len: int, length: int, model_dtype, kv=None):
    """The baseline: gather + dequantize the cache (unless ``kv`` is given), then SDPA (uniform lengths)."""
    import torch.nn.functional as F

    k, v = kv or gather_dequant(b, length, model_dtype)
    seqs, heads, hd = len(b.seq_lens), b.query.shape[1], b.query.shape[2]
    q = b.query.to(k.dtype).view(seqs, q_len, heads, hd).transpose(1, 2)
    o = F.scaled_dot_product_attention(q, k, v, scale=b.scale, is_causal=q_len > 1, enable_gqa=True)
    return o.transpose(1, 2).reshape(-1, heads, hd)
