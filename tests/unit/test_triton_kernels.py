"""The Triton kernels (kvdiag.kernels.store / attention / zero) against the torch references.

On CPU (CI) they run under TRITON_INTERPRET=1 at tiny sizes. With KVDIAG_TEST_DEVICE=cuda
they run compiled on the GPU, at the tiny sizes and at full sizes, with fresh random
inputs and outputs poisoned with NaN beforehand so an unwritten element fails.
Stores must match bit for bit (codes and scales); attention within float32 / bf16 tolerance.
"""

import importlib
import math
import os
import subprocess
import sys

import pytest

DEV = os.environ.get("KVDIAG_TEST_DEVICE", "cpu")
GPU = DEV.startswith("cuda")
# The interpreter works only if TRITON_INTERPRET=1 is set before triton's first import in the process
# (triton.language's own @jit helpers are decorated then) and while kernels run. It is set here, at
# collection, restored right after the import and set again around each test of this file (fixture
# below); if something imported triton earlier, one test re-runs this file in a subprocess.
IN_SUBPROCESS = not GPU and "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
_prev = os.environ.get("TRITON_INTERPRET")
if not GPU:
    os.environ["TRITON_INTERPRET"] = "1"
try:
    triton = pytest.importorskip("triton")
    if not IN_SUBPROCESS:
        store, attention, zero, bench_kernels = (importlib.import_module(m) for m in (
            "kvdiag.kernels.store", "kvdiag.kernels.attention", "kvdiag.kernels.zero", "kvdiag.bench.kernel_rows"))
        if store.interpreted() == GPU:  # imported earlier in the other mode
            store, attention, zero, bench_kernels = (importlib.reload(m) for m in (store, attention, zero,
                                                                                    bench_kernels))
finally:
    if _prev is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = _prev

import torch  # noqa: E402

from kvdiag.bench.measure import paged_batch  # noqa: E402
from kvdiag.dtypes import BUILTIN_DTYPES  # noqa: E402
from kvdiag.kernels import reference  # noqa: E402

if GPU and not torch.cuda.is_available():
    pytest.skip("KVDIAG_TEST_DEVICE=cuda but CUDA is not available", allow_module_level=True)
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the interpreter's numpy use
in_process = pytest.mark.skipif(IN_SUBPROCESS, reason="triton was imported before TRITON_INTERPRET; see the "
                                "subprocess test")


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    """The interpreter also reads TRITON_INTERPRET while kernels run."""
    if not GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.mark.skipif(not IN_SUBPROCESS, reason="the kernel tests run in this process")
def test_kernels_in_an_interpreter_subprocess():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__], env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


ALL_DTYPES = list(BUILTIN_DTYPES)
SIZES = ["tiny", "full"] if GPU else ["tiny"]


def _same_bits(a, b) -> bool:
    if a is None:
        return b is None
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _poisoned(shape, dtype):
    """A cache tensor full of NaN (float storage) or of the code pattern 0x7f (1-byte storage)."""
    t = torch.empty(shape, dtype=dtype, device=DEV)
    if t.element_size() == 1:
        t.view(torch.uint8).fill_(0x7F)
    else:
        t.fill_(math.nan)
    return t


def _poison_allocator(nbytes: int) -> None:
    """Leave a freed NaN block of ``nbytes`` for the next allocations (outputs made inside kernels)."""
    torch.full((nbytes // 4 + 1,), math.nan, device=DEV)


def _store_inputs(kv_dtype, size, model_dtype):
    tokens, kvh, hd, bs = (37, 3, 16, 4) if size == "tiny" else (256 * 1024, 8, 128, 16)
    torch.manual_seed(ALL_DTYPES.index(kv_dtype))
    qkv = torch.randn(tokens, 3, kvh, hd, device=DEV) * torch.rand(tokens, 3, kvh, 1, device=DEV) * 4
    qkv[3, 1, 1] = 0.0  # an all-zero head: the 1e-6 scale floor
    qkv[5, 1, 0] = 0.0  # exact .5 ties after dividing by the scale 0.5
    qkv[5, 1, 0, :6] = torch.tensor([63.5, 1.25, -1.25, 0.25, -63.25, 0.75])
    qkv = qkv.to(model_dtype)
    nb = tokens // bs + 3
    slots = torch.randperm(nb * bs, device=DEV)[:tokens]
    slots[torch.rand(tokens, device=DEV) < 0.1] = -1
    return qkv[:, 1], qkv[:, 2], slots, (nb, bs, kvh, hd)  # K and V are strided views, as in the engine


# the fast paths (kvdiag.kernels.store.fast_paths, default; KVDIAG_TRITON_FAST=0 turns them off) change
# compiled kernels only: both settings are checked on the GPU
FAST = [False, True] if GPU else [False]


def _fast(monkeypatch, fast: bool) -> None:
    monkeypatch.setenv("KVDIAG_TRITON_FAST", "1" if fast else "0")


@in_process
@pytest.mark.parametrize("fast", FAST)
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_dtype", ALL_DTYPES)
def test_store_matches_reference_bit_for_bit(kv_dtype, model_dtype, size, fast, monkeypatch):
    if size == "full" and model_dtype == torch.float32:
        pytest.skip("full size runs the engine's bf16 shape only")
    if fast and BUILTIN_DTYPES[kv_dtype].quant == "none":
        pytest.skip("the fast paths change only quantizing stores")
    _fast(monkeypatch, fast)
    key, value, slots, shape = _store_inputs(kv_dtype, size, model_dtype)
    d = BUILTIN_DTYPES[kv_dtype]
    storage = d.torch_dtype(model_dtype)
    per_token = d.quant == "per_token_head"
    caches = [_poisoned(shape, storage), _poisoned(shape, storage)]
    caches += [_poisoned(shape[:3], torch.float32) for _ in range(2)] if per_token else [None, None]
    ours = [None if c is None else c.clone() for c in caches]
    scales = (torch.tensor(0.37, device=DEV), 2.0)  # a device tensor (the engine's) and a float
    reference.store_kv(key, value, caches[0], caches[1], slots, kv_dtype, *scales, caches[2], caches[3])
    store.store_kv(key, value, ours[0], ours[1], slots, kv_dtype, *scales, ours[2], ours[3])
    for want, got in zip(caches, ours):
        assert _same_bits(want, got)
    written = slots[slots >= 0]
    assert not ours[0].flatten(0, 1)[written].float().isnan().any()


@in_process
@pytest.mark.parametrize("kv_dtype", ["bfloat16", "int8_per_token_head"])
def test_store_on_a_persistent_grid_matches_reference(kv_dtype):
    """Fewer programs than tiles: each program loops over several tiles of tokens."""
    key, value, slots, shape = _store_inputs(kv_dtype, "tiny", torch.bfloat16)
    storage = BUILTIN_DTYPES[kv_dtype].torch_dtype(torch.bfloat16)
    per_token = BUILTIN_DTYPES[kv_dtype].quant == "per_token_head"
    want = [_poisoned(shape, storage), _poisoned(shape, storage)]
    want += [_poisoned(shape[:3], torch.float32) for _ in range(2)] if per_token else [None, None]
    got = [None if c is None else c.clone() for c in want]
    reference.store_kv(key, value, *want[:2], slots, kv_dtype, 1.0, 1.0, *want[2:])
    store.store_kv(key, value, *got[:2], slots, kv_dtype, 1.0, 1.0, *got[2:], block_t=2, programs=3, stages=2)
    assert all(_same_bits(w, g) for w, g in zip(want, got))


def _batches(size):
    """(name, q_lens, seq_lens, num_splits) of the attention cases."""
    tiny = [("decode", [1, 1, 1, 1], [1, 5, 17, 33], None), ("decode-3-splits", [1, 1, 1, 1], [1, 5, 17, 33], 3),
            ("decode-empty-seq", [1, 0, 1], [5, 3, 9], 2), ("prefill-over-prefix", [7, 1, 1, 5, 13],
                                                             [7, 9, 16, 22, 13], None)]
    if size == "tiny":
        return tiny
    g = torch.Generator().manual_seed(1)
    ragged = torch.randint(1, 4097, (32,), generator=g).tolist()
    return [("decode-32x4096", [1] * 32, [4096] * 32, None), ("decode-ragged", [1] * 32, ragged, None),
            ("prefill-ragged", [512, 1, 300, 1000], [1024, 2000, 300, 3000], None)]


def _layouts(size):
    """(heads, kv_heads, head_size, block_size, model dtype)."""
    if size == "tiny":
        return [(4, 2, 16, 4, torch.float32), (7, 1, 64, 16, torch.bfloat16)]
    return [(32, 8, 128, 16, torch.bfloat16), (14, 2, 64, 32, torch.bfloat16), (4, 2, 128, 16, torch.float32)]


def _attn_dtypes(size, layout):
    """Every dtype on CPU; on the GPU (where each combination compiles) a cover of the quant modes."""
    if not GPU:
        return ALL_DTYPES
    if size == "full" and layout == _layouts("full")[0]:
        return ["auto", "fp8", "fp8_e5m2", "int8_per_token_head", "fp8_per_token_head"]
    if layout[4] == torch.float32:
        return ["auto", "fp8_e5m2", "int8_per_token_head"]
    return ["auto", "fp8", "int8_per_token_head"]


ATTN_CASES = [(size, kv, lay, bat, fast) for size in SIZES for lay in _layouts(size) for kv in _attn_dtypes(size, lay)
              for bat in _batches(size) for fast in FAST
              if not fast or (lay[4] == torch.bfloat16 and kv in ("fp8", "fp8_e5m2", "int8_per_token_head"))]


def _rel_err(out, want):
    return float((out.double() - want.double()).norm() / want.double().norm())


@in_process
@pytest.mark.parametrize("size,kv_dtype,layout,batch,fast", ATTN_CASES,
                         ids=[f"{s}-{k}-{l[0]}x{l[1]}x{l[2]}bs{l[3]}-{b[0]}" + ("-fast" if f else "")
                              for s, k, l, b, f in ATTN_CASES])
def test_paged_attention_matches_reference(size, kv_dtype, layout, batch, fast, monkeypatch):
    _fast(monkeypatch, fast)
    heads, kvh, hd, bs, model_dtype = layout
    name, q_lens, seq_lens, splits = batch
    b = paged_batch(kv_dtype, q_lens, seq_lens, heads, kvh, hd, bs, model_dtype, DEV, seed=len(name))
    want = reference.paged_attention(*b.args())
    _poison_allocator(b.query.numel() * 4 * 16 * 4)
    out = attention.paged_attention(*b.args(), num_splits=splits)
    assert out.shape == want.shape and out.dtype == want.dtype
    assert torch.isfinite(out).all()
    assert _rel_err(out, want) < (2e-5 if model_dtype == torch.float32 else 1e-2)


@pytest.mark.skipif(not GPU, reason="the register conversions exist compiled only (inline PTX)")
@pytest.mark.parametrize("storage,cdt,fast", [(torch.int8, torch.bfloat16, 1), (torch.int8, torch.float16, 4),
                                              (torch.float8_e4m3fn, torch.float16, 2),
                                              (torch.float8_e5m2, torch.float16, 3)])
@pytest.mark.parametrize("pure", [False, True])
def test_register_conversions_of_all_1_byte_codes_are_exact(storage, cdt, fast, pure):
    """attention.to_compute's inline-PTX conversions (pure or not) give torch's conversion of every code."""
    @triton.jit
    def kern(x, y, CDT: triton.language.constexpr, FAST: triton.language.constexpr,
             PURE: triton.language.constexpr):
        o = triton.language.arange(0, 256)
        triton.language.store(y + o, attention.to_compute(triton.language.load(x + o), CDT, FAST, PURE))

    codes = torch.arange(256, dtype=torch.int32, device=DEV).to(torch.uint8).view(torch.int8).view(storage)
    got = torch.full((256,), math.nan, dtype=cdt, device=DEV)
    kern[(1,)](codes, got, CDT=attention._TL[cdt], FAST=fast, PURE=pure)
    assert attention._FAST[(storage, cdt)] == fast
    torch.testing.assert_close(got, codes.to(cdt), rtol=0, atol=0, equal_nan=True)


@in_process
@pytest.mark.parametrize("kv_dtype", ["auto", "int8_per_token_head"])
def test_attention_reads_unwritten_slots_only_with_whole_page_reads(kv_dtype):
    b = paged_batch(kv_dtype, [3, 1, 1], [6, 10, 16], 4, 2, 16, 4, torch.float32, DEV)
    unused = ~b.used_slots()
    if b.v_scale_cache is None:
        b.v_cache[unused] = math.nan  # V of every slot no sequence wrote, last blocks' tails included
    else:
        b.v_scale_cache[unused] = math.nan
    out = attention.paged_attention(*b.args(), num_splits=2)
    assert torch.isfinite(out).all()
    assert _rel_err(out, reference.paged_attention(*b.args())) < 2e-5
    bad, want = attention.paged_attention(*b.args(), True), reference.paged_attention(*b.args(), True)
    assert torch.equal(bad.isnan(), want.isnan()) and bad.isnan()[:4].all() and not bad.isnan()[4].any()


@in_process
@pytest.mark.parametrize("kv_dtype", ["auto", "fp8", "int8_per_token_head"])
@pytest.mark.parametrize("whole_page", [False, True])
def test_fixed_length_splits_give_the_same_bits_at_any_table_width(kv_dtype, whole_page):
    """``split_tokens`` (the engine's decode): a token's result does not depend on how many (empty) splits the
    block table's width makes, split or not - what lets a CUDA graph sized for the longest context replay an
    eager step bit for bit."""
    model_dtype = torch.bfloat16 if GPU else torch.float32
    b = paged_batch(kv_dtype, [1, 1, 1, 1], [1, 6, 17, 33], 4, 2, 16, 4, model_dtype, DEV, seed=3)
    wide = torch.zeros(4, b.block_tables.shape[1] + 23, dtype=torch.int32, device=DEV)
    wide[:, :b.block_tables.shape[1]] = b.block_tables
    narrow = b.block_tables[:, :9]  # 36 tokens: 3 splits of 16 against 28 in the wide table
    run = dict(whole_page_reads=whole_page, block_n=16, split_tokens=16)
    args = list(b.args())
    got = [attention.paged_attention(*args[:5], t, *args[6:], **run) for t in (narrow, wide)]
    assert torch.equal(got[0], got[1])
    assert _rel_err(got[0], reference.paged_attention(*b.args(), whole_page)) < (2e-5 if not GPU else 1e-2)
    short = [attention.paged_attention(args[0][:2], *args[1:3], args[3][:3], args[4][:2], t[:2], *args[6:], **run)
             for t in (narrow[:, :4], wide)]  # 6 tokens: one split, no combine, against 28 splits
    assert torch.equal(short[0], short[1]) and torch.equal(short[0], got[0][:2])


def _zero_tensors(size):
    if size == "tiny":
        shapes = [((10, 4, 2, 16), torch.bfloat16), ((10, 4, 2, 16), torch.float8_e4m3fn), ((10, 4, 2), torch.float32),
                  ((10, 4, 2, 16), torch.int8), ((10, 3), torch.float32)]  # the last: 12-byte blocks, reference path
        return [torch.randn(s, device=DEV).to(dt) for s, dt in shapes], [1, 7, 3]
    tensors = [torch.randn(2048, 16, 8, 128, device=DEV).to(torch.bfloat16) for _ in range(48)]
    return tensors, torch.randperm(2048)[:1000].tolist()


@in_process
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("as_tensor,group", [(False, None), (True, None), (False, 3)])
def test_zero_blocks_zeroes_listed_blocks_of_every_tensor(size, as_tensor, group):
    """``group``: tensors per program (3: several programs per block, the last one's group partial)."""
    tensors, ids = _zero_tensors(size)
    want = [t.clone() for t in tensors]
    reference.zero_blocks(ids, want)
    zero.zero_blocks(torch.tensor(ids, device=DEV) if as_tensor else ids, tensors + [None], group=group or zero.GROUP)
    for w, t in zip(want, tensors):
        assert _same_bits(w, t)
    assert (tensors[0][ids].float() == 0).all()


@in_process
def test_zero_blocks_reuses_its_plan_only_for_the_same_live_tensors():
    """zero.py caches each tensor list's offset table without keeping the tensors alive; a new list in the
    old one's place (same ids possible once freed) gets a new table."""
    import gc
    import weakref

    for _ in range(2):
        tensors, ids = _zero_tensors("tiny")
        want = [t.clone() for t in tensors]
        for i in ids:  # one block per call: the second and third reuse the plan
            reference.zero_blocks([i], want)
            zero.zero_blocks([i], tensors)
        assert all(_same_bits(w, t) for w, t in zip(want, tensors))
        ref = weakref.ref(tensors[0])
        del tensors, want
        gc.collect()
        assert ref() is None


@pytest.mark.skipif(not GPU, reason="direct launches happen on the GPU only")
@pytest.mark.parametrize("direct", ["1", "0"])
def test_direct_launches_keep_alignment_specializations_apart(direct, monkeypatch):
    """kernels/launch.py reuses a compiled kernel only for arguments of the same specialization: a query whose
    address and head stride are not multiples of 16 (launched after aligned ones) still gives the right
    result, directly launched or through Triton's dispatch."""
    monkeypatch.setenv("KVDIAG_TRITON_DIRECT", direct)
    b = paged_batch("int8_per_token_head", [1] * 4, [40, 7, 33, 64], 8, 2, 64, 16, torch.bfloat16, DEV, seed=5)
    want = reference.paged_attention(*b.args())
    for _ in range(2):
        assert _rel_err(attention.paged_attention(*b.args()), want) < 1e-2
    wide = torch.zeros(4, 8, 65, dtype=torch.bfloat16, device=DEV)
    wide[:, :, 1:] = b.query
    b.query = wide[:, :, 1:]  # 2 bytes past a 16-byte boundary, head stride 65
    assert b.query.data_ptr() % 16 and b.query.stride(1) % 16
    for _ in range(2):
        assert _rel_err(attention.paged_attention(*b.args()), want) < 1e-2


@pytest.mark.skipif(not GPU, reason="dispatch picks Triton only for CUDA tensors")
def test_dispatch_uses_triton_on_cuda_unless_forced(monkeypatch):
    from kvdiag.kernels import dispatch

    fns = ("store_kv", "paged_attention", "zero_blocks")
    assert all(dispatch.backend(f, torch.device(DEV)) == "triton" for f in fns)
    monkeypatch.setenv("KVDIAG_KERNELS", "reference")
    assert dispatch.backend("store_kv", torch.device(DEV)) == "reference"


@pytest.mark.slow
@in_process
@pytest.mark.skipif(GPU, reason="the GPU runs `kvdiag bench` itself")
def test_bench_plumbing_at_tiny_size_reports_every_row_and_ratio():
    """`kvdiag bench`'s measurement code end to end on CPU (interpreted kernels, host timing, a 2-layer
    model for the engine row): every row, baseline and ratio present and positive; the render works."""
    from kvdiag.bench.run import judge, run_bench
    from kvdiag.cli.bench_cmd import render
    from kvdiag.render.cells import console

    record = run_bench(size="tiny", device="cpu")
    kernels = [r for r in record["rows"] if r["kernel"] != "engine"]
    assert {r["kernel"] for r in kernels} == {"store", "decode", "prefill", "zero"}
    assert len([r for r in kernels if r["kernel"] == "store"]) == len(ALL_DTYPES)
    for r in kernels:
        assert r["ms"] > 0 and r["gbps"] > 0 and r["vs_copy"] > 0 and "reference" in r["baselines"]
        assert ("token_head_grid" in r["baselines"]) == (r["kernel"] == "store")
        assert ("sdpa" in r["baselines"]) == (r["kernel"] in ("decode", "prefill"))
    for r in kernels:
        if r["kernel"] in ("decode", "prefill"):
            assert r["extra"]["rel_err_vs_fp32_sdpa"] < 1e-2  # the baseline computes the same attention
    engine = [r for r in record["rows"] if r["kernel"] == "engine"]
    assert [r["batch"] for r in engine] == [1, 32] and all(r["builtin_tok_s"] > 0 for r in engine)
    assert record["targets"] == []
    judged = judge(record["rows"])  # what a full run would judge, here on tiny numbers
    assert {t["target"] for t in judged} >= {"store >= 90% of copy bandwidth", "zero >= 80% of copy bandwidth"}
    render(record, console())
