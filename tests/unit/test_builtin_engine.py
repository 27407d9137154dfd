"""BuiltinEngine behaviour: dtypes, limits, scheduling, shared-context scoring, sleep/wake, shutdown, faults."""

import gc
import math
import os
import shutil
import warnings
import weakref
from pathlib import Path

import pytest
import torch

from kvdiag.dtypes import BUILTIN_DTYPES
from kvdiag.engines.base import Engine, EngineSpec, engine_dtypes
from kvdiag.engines.builtin.block_manager import BlockManager
from kvdiag.engines.builtin.engine import BuiltinEngine
from kvdiag.engines.builtin.faults import Faults
from kvdiag.errors import UserError

DEV = os.environ.get("KVDIAG_TEST_DEVICE", "cpu")
PROMPTS = ["The cache holds keys", "and values of every layer, block by block; ", "short", "x" * 40]
FILLER = ["Something else entirely, to overwrite the blocks with other keys and values!" * 2]


@pytest.fixture
def model(random_model):
    return random_model("llama", hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=64, init_std=0.15)


def _start(path, **kw):
    e = BuiltinEngine()
    kw.setdefault("num_blocks", 48)
    e.start(EngineSpec(model=path, device=DEV, block_size=16, engine_args={"ignore_eos": True}, **kw))
    return e


def _greedy(e, prompts=PROMPTS, n=20):
    return [(c.token_ids, c.logprobs) for c in e.generate(prompts, n, greedy=True)]


def _live_tensors():
    gc.collect()
    with warnings.catch_warnings():  # isinstance() on some torch module objects warns
        warnings.simplefilter("ignore")
        return [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]


def _storages(tensors):
    keys = set()
    for t in tensors:
        if t is None or t.device.type == "meta":
            continue
        s = t.untyped_storage()
        keys.add((s.data_ptr(), s.nbytes()))
    return keys


def _kv_tensors(e):
    kv = e.kv
    tables = [t for l in kv.views for t in (l.k, l.v, l.k_scale, l.v_scale)] + [kv.ptr_table, kv.stride_table]
    return kv.tensors() + [kv.k_scales, kv.v_scales] + tables


def test_dtypes_listed_without_starting_and_protocol():
    assert BuiltinEngine.supported_kv_dtypes() == list(BUILTIN_DTYPES) and len(BUILTIN_DTYPES) == 8
    assert engine_dtypes("builtin") == list(BUILTIN_DTYPES)
    e = BuiltinEngine()
    assert isinstance(e, Engine) and e.name == "builtin"
    caps = e.capabilities
    assert caps.sleep_levels == (1, 2) and caps.kv_access and caps.full_logits
    with pytest.raises(UserError, match="fault"):
        Faults.parse(["nope"])
    assert Faults.parse(["whole_page_reads"]).enabled == ("whole_page_reads",)


def test_every_kv_dtype_runs_and_switching_reuses_the_weights(model):
    e = _start(model)
    weight = e.model.model.embed_tokens.weight
    ctx, cont = [e.encode(p) for p in PROMPTS[:2]], [e.encode(" next")[1:]] * 2
    base = e.score(ctx, cont, top_k=-1)
    base_gen = _greedy(e)
    drifts = {}
    for name, d in BUILTIN_DTYPES.items():
        e.set_kv_dtype(name)
        layer = e.kv_blocks().layers[0]
        assert layer.k.dtype == d.torch_dtype(torch.float32) and layer.k.shape == (48, 16, 2, 64)
        assert (layer.k_scale is not None) == (d.quant == "per_token_head")
        if layer.k_scale is not None:
            assert layer.k_scale.shape == (48, 16, 2) and layer.k_scale.dtype == torch.float32
        gen = e.generate(PROMPTS, 8, greedy=True)
        assert all(math.isfinite(x) for g in gen for x in g.logprobs)
        got = e.score(ctx, cont, top_k=-1)
        drift = max((a.distributions - b.distributions).abs().max().item() for a, b in zip(base, got))
        drifts[name] = drift  # max |logprob difference| over the whole vocabulary
        assert drift < (0.1 if d.quant == "none" else 0.5 if d.storage == "int8" else 3.0), (name, drift)
    assert drifts["auto"] == 0 and drifts["int8_per_token_head"] < drifts["fp8_per_token_head"] < drifts["fp8"]
    e.start(EngineSpec(model=model, device=DEV, block_size=16, num_blocks=48, engine_args={"ignore_eos": True}))
    assert e.weight_loads == 1 and e.model.model.embed_tokens.weight is weight
    assert _greedy(e) == base_gen
    e.start(EngineSpec(model=model, device=DEV, kv_cache_dtype="int8"))  # alias; size from kv_cache_memory
    assert e.kv.kv_dtype == "int8_per_token_head" and e.weight_loads == 1
    per_block = 2 * 2 * 16 * 2 * 64 * 1 + 2 * 2 * 16 * 2 * 4  # layers * (K+V codes + K+V scales)
    assert e.kv.num_blocks == (64 << 20) // per_block
    with pytest.raises(UserError, match="kv-cache dtype"):
        e.set_kv_dtype("int4")
    e.shutdown()


@pytest.mark.slow
@pytest.mark.skipif(DEV != "cpu", reason="dtypes on threads: the CPU path of accuracy --isolate run")
def test_engines_sharing_weights_on_two_threads_give_what_each_gives_alone(model):
    # accuracy --isolate run on the CPU: two kv dtypes at once, one copy of the weights; the results must be
    # those of each dtype run alone
    import threading

    dtypes = ("auto", "fp8", "int8_per_token_head", "fp8_per_token_head")
    alone = {}
    for d in dtypes:
        e = _start(model, kv_cache_dtype=d)
        alone[d] = _greedy(e)
        e.shutdown()
    first, second = _start(model), BuiltinEngine()
    second.share_weights(first)
    got, errors = {}, []

    def work(engine, names):
        try:
            for d in names:
                engine.start(EngineSpec(model=model, device=DEV, block_size=16, num_blocks=48, kv_cache_dtype=d,
                                        engine_args={"ignore_eos": True}))
                got[d] = _greedy(engine)
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(first, dtypes[::2])),
               threading.Thread(target=work, args=(second, dtypes[1::2]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and got == alone
    assert (first.weight_loads, second.weight_loads) == (1, 0)
    assert second.model is first.model and second.tokenizer is not first.tokenizer
    second.shutdown()
    assert first.model is not None and _greedy(first) == alone["int8_per_token_head"]  # the other keeps them
    first.shutdown()


def test_the_plain_tokenizer_encodes_and_decodes_as_transformers_does(model, tmp_path):
    # the builtin engine reads a PreTrainedTokenizerFast's tokenizer.json through `tokenizers` itself (no
    # transformers import); transformers' class over the same files is the oracle
    import json

    from transformers import PreTrainedTokenizerFast

    from kvdiag.assets import TINY_MODEL
    from kvdiag.engines.builtin import loader, tokenizer

    texts = ["", " ", "k1=v1 k2=v2 ; key=", "  two  spaces ", "<s>inside</s>", "Grüße, 東京 ✓\n\ttab", "x" * 300]
    for path in (TINY_MODEL, Path(model)):
        ours, theirs = tokenizer.plain(path), PreTrainedTokenizerFast.from_pretrained(str(path))
        assert ours is not None, path
        assert (ours.bos_token_id, ours.eos_token_id) == (theirs.bos_token_id, theirs.eos_token_id)
        for text in texts:
            for special in (True, False):
                ids = ours.encode(text, add_special_tokens=special)
                assert ids == theirs.encode(text, add_special_tokens=special), (text, special)
                for skip in (True, False):
                    assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    # a config whose add_bos_token disagrees with the file's template: left to transformers
    bent = tmp_path / "bent"
    shutil.copytree(model, bent)
    cfg = json.loads((bent / "tokenizer_config.json").read_text())
    (bent / "tokenizer_config.json").write_text(json.dumps({**cfg, "add_bos_token": False}))
    assert tokenizer.plain(bent) is None
    assert type(loader.load_tokenizer(bent)).__module__.startswith("transformers")
    assert isinstance(loader.load_tokenizer(Path(model)), tokenizer.JsonTokenizer)


def test_limits_give_clear_errors(model):
    e = _start(model, num_blocks=3, max_model_len=64)
    with pytest.raises(UserError, match="prompt of 81 tokens exceeds max_model_len 64"):
        e.generate(["y" * 80], 4)
    with pytest.raises(UserError, match="needs 4 KV blocks; the cache has 3"):
        e.generate(["y" * 40], 30)  # prompt plus max_tokens (capped at max_model_len) must fit
    with pytest.raises(UserError, match="KV blocks"):
        e.score(["y" * 40], ["z" * 20])
    e.start(EngineSpec(model=model, device=DEV, num_blocks=4, max_model_len=64))
    out = e.generate(["y" * 40], 30)  # generation stops at max_model_len
    assert len(out[0].prompt_token_ids) + len(out[0].token_ids) == 64 and out[0].finish_reason == "length"
    assert e.weight_loads == 1
    e.shutdown()
    with pytest.raises(UserError, match="no block"):
        _start(model, num_blocks=None, kv_cache_memory=100)


def test_batching_and_admission_limits_do_not_change_greedy_outputs(model):
    e = _start(model, max_num_seqs=2, num_blocks=7)  # at most 2 running, waits for freed blocks
    batched = _greedy(e, n=24)
    alone = [_greedy(e, [p], n=24)[0] for p in PROMPTS]
    for (bt, bl), (at, al) in zip(batched, alone):
        assert bt == at and bl == pytest.approx(al, abs=1e-5)
    assert e.blocks.num_free == 7
    e.shutdown()


def test_sampling_seed_stop_and_logprobs(model):
    e = _start(model)
    a = e.generate(PROMPTS, 12, greedy=False, seed=7, logprobs=3)
    b = e.generate(PROMPTS, 12, greedy=False, seed=7)
    c = e.generate(PROMPTS, 12, greedy=False, seed=8)
    assert [x.token_ids for x in a] == [x.token_ids for x in b] != [x.token_ids for x in c]
    assert all(len(t) == 3 and max(t.values()) <= 0 for x in a for t in x.top_logprobs)
    g = e.generate([PROMPTS[0]], 12, greedy=True)[0]
    stop = g.text[4:6]
    s = e.generate([PROMPTS[0]], 12, greedy=True, stop=[stop])[0]
    assert s.finish_reason == "stop" and s.text == g.text[:g.text.index(stop)]
    assert e.generate([PROMPTS[0]], 0) [0].token_ids == []
    e.shutdown()


def test_score_shared_contexts_equal_scoring_each_pair_alone(model):
    e = _start(model, num_blocks=40, max_num_seqs=3)
    ctxs = [e.encode("p" * 15), e.encode("q" * 20), [1, 2, 3]]  # 16 tokens (a full block), 21, 3
    conts = [[7], [8, 9, 10], list(range(40, 58)), [5, 6]]
    contexts = [c for c in ctxs for _ in conts] + ["A string context"]
    continuations = conts * len(ctxs) + [" and its string continuation"]
    calls = []
    forward = e._forward
    e._forward = lambda entries, **kw: calls.append(sum(len(t) for _, _, t in entries)) or forward(entries, **kw)
    shared = e.score(contexts, continuations, top_k=2)
    unique = sum(len(c) for c in ctxs) + len(e.encode(contexts[-1]))
    cont_tokens = sum(len(c) - 1 for c in conts) * len(ctxs) + len(e._ids(continuations[-1], False)) - 1
    assert sum(calls) == unique + cont_tokens  # each distinct context prefilled once
    e._forward = forward
    assert e.blocks.num_free == 40
    for ctx, cont, s in zip(contexts, continuations, shared):
        alone = e.score([ctx], [cont], top_k=2)[0]
        assert s.logprobs == pytest.approx(alone.logprobs, abs=1e-5)
        assert s.is_greedy == alone.is_greedy and len(s.top_logprobs) == len(s.logprobs)
    assert e.score([[1, 2]], [[]])[0].logprobs == []
    e.shutdown()


def test_block_manager_fork_free_and_fresh_zeroing(model):
    fresh, copies = [], []
    bm = BlockManager(6, 4, fresh.append, lambda s, d: copies.append((s, d)))
    t = bm.grow([], 10)
    assert t == [0, 1, 2] and fresh == [[0, 1, 2]]
    f = bm.fork(t, 10)  # two full blocks shared, the half-full third copied
    assert f[:2] == [0, 1] and copies == [(2, f[2])] and bm.refs[0] == 2
    assert fresh == [[0, 1, 2]]  # the copy overwrites the forked block whole: it is not zeroed first
    assert bm.slots(f, 7, 10) == [7, f[2] * 4, f[2] * 4 + 1]
    bm.free(f)
    bm.free(t)
    assert bm.num_free == 6 and bm.used_blocks() == []
    e = _start(model, num_blocks=8)
    for layer in e.kv_blocks().layers:
        layer.k.fill_(5.0)
        layer.v.fill_(5.0)
    table = e.blocks.grow([], 20)
    assert all((layer.k[table] == 0).all() and (layer.k[2:] == 5).all() for layer in e.kv_blocks().layers)
    e.shutdown()


def _with_scales(path, tmp_path, k=0.02, v=0.03):
    from safetensors.torch import save_file

    dst = shutil.copytree(path, tmp_path / "scaled")
    save_file({f"model.layers.{i}.self_attn.{n}_scale": torch.tensor(s) for i in range(2)
               for n, s in (("k", k), ("v", v))}, str(dst / "kv_scales.safetensors"))
    return str(dst)


@pytest.mark.parametrize("faulty", [False, True])
def test_fp8_checkpoint_scales_used_and_restored_after_level2_wake(model, tmp_path, faulty):
    e = _start(_with_scales(model, tmp_path), kv_cache_dtype="fp8",
               faults=("fp8_scales_lost_on_wake",) if faulty else ())
    assert e.kv.k_scales.tolist() == pytest.approx([0.02] * 2) and e.kv.v_scales.tolist() == pytest.approx([0.03] * 2)
    before = _greedy(e, PROMPTS[:1])
    layer = e.kv_blocks().layers[0]
    assert layer.k.float().abs().max() > 1.0  # codes of x / 0.02, not of x
    e.sleep(2)
    e.wake_up()
    if faulty:
        assert e.kv.k_scales.tolist() == [0.0, 0.0] and _greedy(e, PROMPTS[:1]) != before
    else:
        assert e.kv.k_scales.tolist() == pytest.approx([0.02] * 2) and _greedy(e, PROMPTS[:1]) == before
    e.shutdown()


@pytest.mark.parametrize("level,staged", [(1, False), (2, False), (2, True), (1, True)])
def test_sleep_wake_restores_outputs_and_frees_memory(model, level, staged):
    e = _start(model, kv_cache_dtype="int8_per_token_head", enable_sleep=True)
    before = _greedy(e)
    e.generate(FILLER, 8)
    kv_keys = _storages(_kv_tensors(e))
    weight_keys = _storages(e.model.parameters())
    weights = [weakref.ref(p) for p in e.model.parameters()]
    old_ptrs = e.kv.ptr_table.clone()
    sizes = [(t.numel(), t.dtype) for l in e.kv.layers for t in (l.k, l.v, l.k_scale, l.v_scale) if t is not None]
    e.sleep(level)
    assert e.kv_blocks() is None
    alive = _storages(_live_tensors())
    assert not alive & kv_keys  # no KV tensor (K, V, scale caches, views, tables) alive while asleep
    if level == 2:
        assert not alive & weight_keys and all(w() is None for w in weights)
    # Occupy what sleep freed, so the allocator cannot hand the same addresses back at wake (on CPU, malloc
    # may): wake must then rebuild the pointer table for caches that really moved.
    squatters = [torch.empty(n, dtype=d) for n, d in sizes]
    with pytest.raises(RuntimeError, match="asleep"):
        e.generate(PROMPTS, 2)
    if staged:
        e.wake_up(["weights"])
        e.wake_up(["kv_cache"])
    else:
        e.wake_up()
    assert e.weight_loads == level  # level 2 re-read the weights from disk
    ptrs = [[l.k.data_ptr(), l.v.data_ptr(), l.k_scale.data_ptr(), l.v_scale.data_ptr()] for l in e.kv.layers]
    assert e.kv.ptr_table.tolist() == ptrs and ptrs != old_ptrs.tolist()
    del squatters
    assert all(v.k.data_ptr() == l.k.data_ptr() for v, l in zip(e.kv.views, e.kv.layers))
    assert _greedy(e) == before
    e.shutdown()


def test_shutdown_leaves_no_engine_tensor_alive(model):
    baseline = {id(t) for t in _live_tensors()}
    e = _start(model, kv_cache_dtype="fp8_per_token_head")
    e.generate(PROMPTS, 4)
    s = e.score(PROMPTS[:1], [" x"], top_k=-1)
    del s
    refs = [weakref.ref(t) for t in list(e.model.parameters()) + _kv_tensors(e) + [e.model.rotary.cos]]
    e.shutdown()
    assert all(r() is None for r in refs)
    leftover = [t for t in _live_tensors() if id(t) not in baseline]
    assert leftover == [], [(type(t), t.shape, t.dtype) for t in leftover[:5]]
    assert e.versions()["kernels"] == "cpu" or DEV != "cpu"


@pytest.mark.slow
def test_fault_stale_views_after_wake(model):
    outputs = {}
    for faulty in (False, True):
        e = _start(model, faults=("stale_views_after_wake",) if faulty else ())
        ref = _greedy(e)
        e.generate(FILLER, 8)  # other K/V into the same blocks
        kv_keys = _storages(e.kv.tensors())
        e.sleep(1)
        assert bool(_storages(_live_tensors()) & kv_keys) == faulty  # stale views keep the old cache alive
        e.wake_up()
        stale = e.kv.views[0].k.data_ptr() != e.kv.layers[0].k.data_ptr()
        assert stale == faulty
        outputs[faulty] = (ref, _greedy(e))
        e.shutdown()
    assert outputs[False][0] == outputs[False][1]
    assert outputs[True][0] != outputs[True][1]


def _poison(e, value=math.nan):
    view = e.kv_blocks()
    free = view.free_blocks()
    assert len(free) == view.num_blocks  # between calls every block is free
    for layer in view.layers:
        layer.k[free] = value
        layer.v[free] = value


@pytest.mark.parametrize("faults", [(), ("whole_page_reads",), ("whole_page_reads", "no_zero_fresh_blocks")])
def test_fault_whole_page_reads_of_unzeroed_blocks_spreads_nan(model, faults):
    e = _start(model, faults=faults)
    ref = _greedy(e)
    _poison(e)
    got = _greedy(e)
    if "no_zero_fresh_blocks" in faults:
        assert got != ref and any(math.isnan(x) for _, lps in got for x in lps)
    else:
        assert got == ref
    e.shutdown()


def test_fault_explicit_bf16_rejected_refuses_only_the_explicit_bfloat16(model):
    with pytest.raises(ValueError, match="^Unsupported data type of kv cache: bfloat16$"):
        _start(model, kv_cache_dtype="bf16", faults=("explicit_bf16_rejected",))
    for dtype in ("auto", "float16", "fp8"):
        e = _start(model, kv_cache_dtype=dtype, faults=("explicit_bf16_rejected",))
        assert e.kv.kv_dtype == dtype
        e.shutdown()


def test_fault_explicit_bf16_misdispatch_runs_the_fp8_path(model):
    out, stored = {}, {}
    e = BuiltinEngine()
    for dtype, faults in (("bfloat16", ()), ("bfloat16", ("explicit_bf16_misdispatch",)), ("fp8", ()),
                          ("float16", ("explicit_bf16_misdispatch",))):
        e.start(EngineSpec(model=model, device=DEV, kv_cache_dtype=dtype, faults=faults, num_blocks=16,
                           engine_args={"ignore_eos": True}))
        assert e.spec.kv_cache_dtype == dtype  # what the engine says it runs
        stored[dtype, faults] = e.kv_blocks().layers[0].k.dtype  # what it really stores
        out[dtype, faults] = _greedy(e, PROMPTS[:2], n=8)
    e.shutdown()
    bad = ("bfloat16", ("explicit_bf16_misdispatch",))
    assert stored[bad] == torch.float8_e4m3fn and stored["bfloat16", ()] == torch.bfloat16
    assert stored["float16", ("explicit_bf16_misdispatch",)] == torch.float16  # only 'bfloat16' is mis-dispatched
    assert out[bad] == out["fp8", ()] != out["bfloat16", ()]


@pytest.mark.slow
def test_fault_v_with_k_scales_changes_outputs_where_the_scales_differ(model, tmp_path):
    def run(path, dtype, faulty):
        e = _start(path, kv_cache_dtype=dtype, faults=("v_with_k_scales",) if faulty else (), num_blocks=16)
        got = e.score(PROMPTS[:2], [" the end"] * 2, top_k=-1)
        e.shutdown()
        return torch.stack([s.distributions[-1] for s in got])

    for dtype in ("int8_per_token_head", "fp8_per_token_head"):  # K's and V's per-token scales always differ
        assert (run(model, dtype, True) - run(model, dtype, False)).abs().max() > 0.05, dtype
    scaled = _with_scales(model, tmp_path)  # per-tensor: k_scale 0.02, v_scale 0.03
    assert (run(scaled, "fp8", True) - run(scaled, "fp8", False)).abs().max() > 0.05
    assert torch.equal(run(model, "fp8", True), run(model, "fp8", False))  # no checkpoint scales: both 1.0
    assert torch.equal(run(model, "auto", True), run(model, "auto", False))
