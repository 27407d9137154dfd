"""kvdiag.kernels.cpu_attention (the CPU paged attention) against the reference, its oracle."""

import math

import pytest
import torch

from kvdiag.dtypes import BUILTIN_DTYPES
from kvdiag.kernels import cpu_attention, dispatch, reference


def _setup(kv_dtype, q_lens, seq_lens, *, share=(), nb=96, bs=4, kvh=2, heads=6, hd=16, seed=0, model=torch.float32,
           shuffle=True):
    """Random K/V stored through store_kv into shuffled blocks. ``share``: (s, t) pairs - sequence t's table
    starts with sequence s's full blocks (a forked context, as the engine's score does)."""
    g = torch.Generator().manual_seed(seed)
    d = BUILTIN_DTYPES[kv_dtype]
    k_cache = torch.zeros(nb, bs, kvh, hd, dtype=d.torch_dtype(model))
    v_cache = torch.zeros_like(k_cache)
    per_token = d.quant == "per_token_head"
    ksc = torch.zeros(nb, bs, kvh) if per_token else None
    vsc = torch.zeros(nb, bs, kvh) if per_token else None
    free = torch.randperm(nb, generator=g).tolist() if shuffle else list(range(nb))[::-1]  # pop(): 0, 1, ...
    parent = dict((t, s) for s, t in share)
    tables = []
    for t, n in enumerate(seq_lens):
        own = [] if t not in parent else tables[parent[t]][:min(n, seq_lens[parent[t]]) // bs]
        ids = own + [free.pop() for _ in range(-(-n // bs) - len(own))]
        tables.append(ids)
        first = len(own) * bs  # shared positions are already written
        k = torch.randn(n - first, kvh, hd, generator=g) * 2
        v = torch.randn(n - first, kvh, hd, generator=g)
        slots = torch.tensor([ids[p // bs] * bs + p % bs for p in range(first, n)], dtype=torch.long)
        reference.store_kv(k.to(model), v.to(model), k_cache, v_cache, slots, kv_dtype, 0.5, 0.25, ksc, vsc)
    width = max(len(t) for t in tables)
    q = (torch.randn(sum(q_lens), heads, hd, generator=g) * 2).to(model)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    return (q, k_cache, v_cache, qsl, torch.tensor(seq_lens, dtype=torch.int32),
            torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32), hd ** -0.5, kv_dtype,
            torch.tensor(0.5), torch.tensor(0.25), ksc, vsc)


def _check(args, **kw):
    want = reference.paged_attention(*args, **kw)
    got = cpu_attention.paged_attention(*args, **kw)
    assert got.shape == want.shape and got.dtype == want.dtype
    tol = 1e-5 if want.dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=0)
    return got


# ragged: a fresh prefill (long and short), decodes, new tokens over a cached prefix (long and short),
# lengths that end mid-block and on a block boundary
Q_LENS, SEQ_LENS = [7, 1, 1, 5, 40, 23, 3, 1], [7, 9, 16, 22, 40, 61, 30, 1]


@pytest.mark.parametrize("kv_dtype", list(BUILTIN_DTYPES))
def test_matches_reference_for_every_dtype(kv_dtype):
    _check(_setup(kv_dtype, Q_LENS, SEQ_LENS))


def test_matches_reference_when_blocks_are_consecutive():  # a fresh prefill's usual layout (read as a slice)
    _check(_setup("fp8_per_token_head", Q_LENS, SEQ_LENS, shuffle=False))


@pytest.mark.parametrize("heads,kvh", [(4, 4), (8, 2), (6, 1)])
def test_matches_reference_for_mha_gqa_and_mqa(heads, kvh):
    _check(_setup("int8_per_token_head", Q_LENS, SEQ_LENS, heads=heads, kvh=kvh))


@pytest.mark.parametrize("model", [torch.bfloat16, torch.float16])
def test_matches_reference_on_a_half_precision_model(model):
    _check(_setup("auto", Q_LENS, SEQ_LENS, model=model))
    _check(_setup("fp8", Q_LENS, SEQ_LENS, model=model))


def test_forked_continuations_share_their_context_blocks():
    # sequence 0 is a context; 1-4 continue it (blocks shared, as engine.score forks them); 5 continues 1's prefix
    q_lens, seq_lens = [30, 3, 2, 3, 17, 1], [30, 33, 32, 33, 47, 29]
    _check(_setup("fp8_per_token_head", q_lens, seq_lens, share=[(0, 1), (0, 2), (0, 3), (0, 4), (1, 5)]))


def test_grouped_short_queries_split_like_the_reference(monkeypatch):
    monkeypatch.setattr(cpu_attention, "GROUP_ELEMENTS", 6 * 3 * 40)  # ~one sequence per group
    _check(_setup("auto", [1, 3, 2, 1, 3], [40, 13, 9, 1, 3]))


def test_unwritten_slots_are_never_read_unless_whole_page_reads():
    args = _setup("auto", [3, 1, 9], [6, 10, 9])
    k_cache, v_cache, tables, lens = args[1], args[2], args[5], args[4].tolist()
    used = {(int(tables[s, p // 4]), p % 4) for s, n in enumerate(lens) for p in range(n)}
    for b in range(k_cache.shape[0]):  # NaN in every slot no sequence wrote, the last blocks' tails included
        for o in range(4):
            if (b, o) not in used:
                k_cache[b, o], v_cache[b, o] = math.nan, math.inf
    out = _check(args)
    assert torch.isfinite(out).all()
    bad = cpu_attention.paged_attention(*args, whole_page_reads=True)
    want = reference.paged_attention(*args, whole_page_reads=True)
    assert torch.isnan(bad).any() and torch.equal(bad.isnan(), want.isnan())  # the same rows and channels


def test_nan_inside_the_context_is_nan_as_in_the_reference():
    args = _setup("auto", [1, 4], [12, 7])
    args[2][int(args[5][0, 1]), 2, 0, 5] = math.nan  # sequence 0, position 6, V of kv head 0
    got, want = cpu_attention.paged_attention(*args), reference.paged_attention(*args)
    assert torch.equal(got.isnan(), want.isnan()) and got.isnan().any()


def test_e4m3_conversion_is_exact_for_all_256_codes():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).reshape(4, 8, 8)
    got, want = cpu_attention.e4m3_to_float(codes), codes.float()
    assert got.dtype == torch.float32 and torch.equal(got.isnan(), want.isnan())
    ok = ~want.isnan()
    assert torch.equal(got[ok].view(torch.int32), want[ok].view(torch.int32))  # bit-exact, -0.0 included


def test_dispatch_routes_cpu_tensors_here_unless_reference_is_forced(monkeypatch):
    args = _setup("fp8", [5, 1], [5, 12])
    calls = []
    real = cpu_attention.paged_attention
    monkeypatch.setattr(cpu_attention, "paged_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.delenv("KVDIAG_KERNELS", raising=False)
    dispatch.paged_attention(*args)
    assert calls == [1]
    monkeypatch.setenv("KVDIAG_KERNELS", "reference")
    assert torch.equal(dispatch.paged_attention(*args), reference.paged_attention(*args)) and calls == [1]
