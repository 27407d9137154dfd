"""`kvdiag poison`: free blocks filled with poison; the builtin engine's S3 faults must be caught.

Unit tests of the cache tools (fill, fingerprint, scan) use hand-made tensors; the check
runs in-process on the builtin engine with a random model, and once through the CLI.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import limited_engines
import pytest
import torch
from conftest import TEST_DEVICE

from kvdiag.case import WorkerContext
from kvdiag.checks import kv_tensors
from kvdiag.checks.poison import run as poison
from kvdiag.engines.base import KVBlockView, KVLayer, KVState
from kvdiag.run.runner import Case

S3 = ["whole_page_reads", "no_zero_fresh_blocks"]


def view_of(dtype, scales=False, num_blocks=6, block_size=4, heads=2, dim=4, layers=2):
    shape = (num_blocks, block_size, heads, dim)

    def t(dt, shp):
        return torch.zeros(shp, dtype=torch.float32).to(dt)

    ls = [KVLayer(t(dtype, shape), t(dtype, shape), t(torch.float32, shape[:3]) if scales else None,
                  t(torch.float32, shape[:3]) if scales else None) for _ in range(layers)]
    return KVBlockView(block_size, num_blocks, ls, lambda: [1, 3, 4], lambda: [0, 2, 5])


@pytest.mark.parametrize("dtype,value,expect", [
    (torch.float32, "nan", math.nan), (torch.bfloat16, "inf", math.inf), (torch.float16, "max", 65504.0),
    (torch.float8_e4m3fn, "nan", math.nan), (torch.float8_e4m3fn, "inf", math.nan),  # e4m3fn has no inf
    (torch.float8_e5m2, "inf", math.inf), (torch.float8_e4m3fn, "max", 448.0), (torch.int8, "nan", -128),
    (torch.int8, "max", 127)])
def test_fill_blocks_writes_the_poison_into_exactly_those_blocks(dtype, value, expect):
    v = view_of(dtype, scales=dtype == torch.int8)
    kv_tensors.fill_blocks(v, [1, 4], value)
    for name, t in kv_tensors.cache_tensors(v):
        f = t.float()
        assert (f[[0, 2, 3, 5]] == 0).all(), name
        got = f[[1, 4]].flatten()
        if name.endswith("scale"):  # float32 scale slots poisoned too
            assert not torch.isfinite(got).any() or value == "max"
        elif math.isnan(expect):
            assert got.isnan().all(), name
        else:
            assert (got == expect).all(), (name, got[:3])


def test_random_poison_is_seeded_and_zero_clears():
    a, b, c = (view_of(torch.bfloat16) for _ in range(3))
    for v, seed in ((a, 7), (b, 7), (c, 8)):
        kv_tensors.fill_blocks(v, [1, 3], "random", seed)
    assert torch.equal(a.layers[0].k.view(torch.int16), b.layers[0].k.view(torch.int16))
    assert not torch.equal(a.layers[0].k.view(torch.int16), c.layers[0].k.view(torch.int16))
    assert (a.layers[1].v[1].view(torch.int16) != 0).float().mean() > 0.9
    kv_tensors.fill_blocks(a, [1, 3], "zero")
    assert all((t.float() == 0).all() for _, t in kv_tensors.cache_tensors(a))


def test_fingerprint_changes_at_the_written_slots_only():
    v = view_of(torch.float8_e4m3fn, scales=True)
    before = kv_tensors.slot_fingerprint(v)
    v.layers[1].v[2, 3, 1, 0] = 1.0  # slot 2*4+3
    v.layers[0].k_scale[5, 0, 0] = 0.5  # slot 20
    changed = (kv_tensors.slot_fingerprint(v) != before).nonzero().flatten().tolist()
    assert changed == [11, 20]


def test_scan_finds_nonfinite_codes_and_bad_scales_but_not_zeroed_slots():
    v = view_of(torch.float8_e4m3fn, scales=True)
    v.layers[1].k.view(torch.uint8)[2, 1, 0, 0] = 0x7F  # fp8 NaN code at slot 9 (its scale fine)
    v.layers[1].k_scale[2, 1] = 1.0
    v.layers[0].v[3, 0] = 2.0  # nonzero codes with scale 0 at slot 12
    v.layers[0].k_scale[4, 2, 1] = math.inf  # slot 18
    scan = kv_tensors.scan_slots(v, torch.arange(24))
    assert (scan.slots, scan.nonfinite, scan.bad_scales) == (24, 1, 2)
    assert scan.first == {"tensor": "0.k_scale", "block": 4, "offset": 2}  # layer, k before v, then slot
    assert kv_tensors.scan_slots(v, torch.tensor([0, 1, 2, 10])).ok  # zero codes with zero scales: fine


def hybrid_view(state_blocks: set[int]):
    """vLLM's hybrid layout in small (tests/support/vllm_hybrid_probe.py): one byte buffer per layer pair, a
    block's page
    is either the attention layer's K/V (bf16, [slots, heads, dim] each) or the Mamba layer's states (a bf16 conv
    state and an fp32 SSM state), at the same bytes."""
    nb, bs, h, d = 4, 8, 2, 4
    page = 2 * bs * h * d * 2  # K and V, bf16: 256 bytes
    buf = torch.zeros(nb * page, dtype=torch.uint8)
    kv = buf.view(torch.bfloat16).view(nb, 2, bs, h, d)
    conv = torch.as_strided(buf.view(torch.bfloat16), (nb, 3, 8), (page // 2, 8, 1))  # 48 bytes at the page start
    ssm = torch.as_strided(buf.view(torch.float32), (nb, 2, 8), (page // 4, 8, 1), 48 // 4)  # 64 bytes after it
    view = KVBlockView(bs, nb, [KVLayer(kv[:, 0], kv[:, 1])], lambda: [], lambda: [],
                       [KVState("0.mixer", {"conv": conv, "ssm": ssm})], lambda: set(state_blocks))
    return view, kv, ssm


def test_poison_fills_the_state_blocks_of_a_hybrid_and_the_scan_reads_each_block_as_its_owner_wrote_it():
    view, kv, ssm = hybrid_view({2})
    kv_tensors.fill_blocks(view, [1, 2], "nan")
    # every tensor of every group, those blocks only; read either way, the overlaid bytes are NaN
    assert torch.isnan(kv[1]).all() and torch.isnan(kv[2]).all() and not torch.isnan(kv[0]).any()
    assert torch.isnan(view.states[0].tensors["conv"][1]).all() and torch.isnan(ssm[2]).all()
    marks = kv_tensors.slot_fingerprint(view)
    with torch.inference_mode():
        kv_tensors.fill_blocks(view, [1, 2], "zero")
    # block 2 held a Mamba state: finite fp32 whose low halves read as bf16 are NaN (0x7fc0): a K/V reading of
    # it would be a false NaN; block 1 held K/V, and one of its slots has a NaN V
    ssm[2] = torch.tensor([0x3F807FC0], dtype=torch.int32).view(torch.float32)
    assert torch.isnan(kv[2]).any() and torch.isfinite(ssm[2]).all()
    kv[1, 1, 3, 0, 0] = float("nan")
    changed = (kv_tensors.slot_fingerprint(view) != marks).nonzero().flatten()
    assert set((changed // view.block_size).tolist()) == {1, 2}  # a state write changes the K/V bytes it overlays
    scan = kv_tensors.scan_slots(view, changed)
    assert (scan.nonfinite, scan.state_blocks, scan.state_nonfinite) == (1, 1, 0)
    assert scan.first == {"tensor": "0.v", "block": 1, "offset": 3}
    ssm[2, 1, 5] = float("inf")  # a state that is not finite is found in its own tensor
    scan = kv_tensors.scan_slots(view, changed)
    assert (scan.nonfinite, scan.state_nonfinite, scan.ok) == (1, 1, False)
    assert scan.first == {"tensor": "0.mixer.ssm", "block": 2}


def test_the_written_kv_slots_of_a_hybrid_are_those_attention_wrote_not_every_slot_of_a_block_whose_state_changed():
    """vLLM's hybrid pages overlay the Mamba states on the attention K/V: attention writing the first slots of a
    poisoned block changes bytes a state reads there. The slots it did not write still hold the poison, and no
    correct attention kernel reads them: they are not written K/V slots holding NaN. A state block the wave wrote
    is still scanned as states, its NaN found there."""
    from dataclasses import replace

    from kvdiag.checks.poison import steps

    view, kv, ssm = hybrid_view({2})
    view = replace(view, free_blocks=lambda: [1, 2, 3])
    steps.fill(view, "nan", 0)
    kv[1, :, :3] = 0.5  # attention writes slots 0-2 of block 1 (K and V): block 1's conv state changes with them
    ssm[2] = 0.25  # the Mamba layer writes the SSM state of block 2, finite; its conv state is left NaN
    got = steps.scan(view, [1, 2, 3])
    assert got["fresh"] == [1, 2] and got["fresh_state_blocks"] == 1
    s = got["scan"]
    assert s["nonfinite"] == 0, s  # slots 3-7 of block 1 hold NaN, but no layer wrote them
    assert (s["state_blocks"], s["state_nonfinite"]) == (1, 1), s
    assert s["first"] == {"tensor": "0.mixer.conv", "block": 2}


def test_blocks_needed_makes_later_waves_reuse_blocks():
    prompts = ["x" * 30, "y" * 5, "z" * 50]
    waves = poison.workload(prompts, 16)
    assert [w.max_tokens for w in waves] == [35, 9, 17]
    assert [len(w.prompts) for w in waves] == [2, 1, 3]
    # tokens <= bytes + 2: wave 1 holds ceil(67/16) + ceil(87/16) = 11 blocks, wave 3 4 + 2 + 5 = 11
    assert poison.blocks_needed(waves, 16) == 11  # so waves 2 and 3 must reuse blocks wave 1 freed


def test_the_engine_kvdiag_sizes_runs_no_more_sequences_at_once_than_a_wave_has(model, monkeypatch):
    """poison sizes the KV cache to its waves; its engine is then asked for no more sequences at once than the
    largest wave holds (vLLM's CUDA graphs of a hybrid need a Mamba block per sequence: with its default 64
    sequences over 57 blocks, vLLM refuses to start zoo:granite-hybrid with its defaults)."""
    seen = []
    real = poison.spec_starter

    def spy(spec):
        seen.append((spec.num_blocks, spec.max_num_seqs))
        return real(spec)

    monkeypatch.setattr(poison, "spec_starter", spy)
    rec = run_case(model, "auto")
    from kvdiag.checks import greedy
    from kvdiag.engines.base import EngineSpec

    waves = poison.workload(greedy.prompt_texts(model, None), EngineSpec(model=model).block_size)
    ((blocks, seqs),) = seen
    assert rec.status == "pass" and seqs == max(len(w.prompts) for w in waves) <= blocks, (seen, rec.findings)


def run_case(model, dtype, engine="builtin", **params):
    case = Case("poison", engine, model, dtype, "kvdiag.checks.poison.run:run",
                params={"device": TEST_DEVICE, **params})
    return poison.run(case, WorkerContext(Path('.'), Path('.')))


@pytest.fixture(scope="module")
def model(random_model):
    return random_model("llama", hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=1)


@pytest.mark.parametrize("dtype,value", [("auto", "nan"), ("fp8", "nan"), ("int8_per_token_head", "random"),
                                         ("fp8_e5m2", "inf")])
def test_clean_engine_passes(model, dtype, value):
    rec = run_case(model, dtype, value=value)
    assert rec.status == "pass", rec.findings
    m = rec.metrics
    assert m["identical"] and m["nonfinite_logprobs"] == 0 and m["kv_nonfinite"] == 0
    assert 0 < m["fresh_blocks"] <= m["poisoned_blocks"]
    assert m["poisoned_blocks"] > m["num_blocks"]  # free blocks were re-poisoned wave after wave


@pytest.mark.parametrize("dtype", ["float16", "fp8_per_token_head"])
def test_unzeroed_whole_page_reads_fail_naming_the_first_difference(model, dtype):
    rec = run_case(model, dtype, faults=S3)
    assert rec.status == "fail"
    kinds = {f.kind for f in rec.findings}
    assert {"divergence", "nan_output"} <= kinds, rec.findings
    div = next(f for f in rec.findings if f.kind == "divergence")
    assert "request 0" in div.message and "position 0" in div.message
    assert rec.metrics["first_difference"]["request"] == 0


@pytest.mark.parametrize("fault", S3)
def test_either_s3_half_alone_is_harmless(model, fault):
    rec = run_case(model, "bfloat16", faults=[fault])
    assert rec.status == "pass", rec.findings


@pytest.mark.parametrize("engine,stage", [
    ("dies_at_once", "workload (zero-filled reference, wave 1)"),
    ("dies_when_poisoned", "workload (blocks poisoned with nan, wave 1; the zero-filled reference ran)")])
def test_an_engine_that_dies_in_a_wave_is_crashed_there_not_an_error_of_kvdiags(model, engine, stage):
    """vLLM's compiled hybrid dies at its first decode (finding 14): poison says the engine crashed, in which run
    and wave, with the frame it was raised in, as memleak does."""
    rec = run_case(model, "auto", engine=f"limited_engines:{engine}", value="nan")
    assert rec.status == "crashed"
    (f,) = rec.findings
    assert f.kind == "crashed" and f.evidence["stage"] == stage
    assert f.message == f"{stage}: RuntimeError: CUDA error: an illegal memory access was encountered"
    assert "limited_engines.py" in f.evidence["where"]


def kvdiag(*args):
    return subprocess.run([sys.executable, "-m", "kvdiag", *args], capture_output=True, text=True)


@pytest.mark.slow
def test_cli_fault_alias_json_and_exit_code(model, tmp_path):
    r = kvdiag("poison", "-m", model, "-d", "bf16", "-d", "int8", "--device", TEST_DEVICE, "--isolate", "run",
               "--fault", "unzeroed_page_reads", "-f", "json", "-o", str(tmp_path / "run"))
    assert r.returncode == 1, r.stderr
    run = json.loads(r.stdout)
    assert [c["status"] for c in run["cases"]] == ["fail", "fail"]
    assert run["cases"][0]["params"]["faults"] == S3


def test_table_names_value_blocks_and_first_difference(model):
    from rich.console import Console

    from kvdiag.checks.poison.view import render
    from kvdiag.results import RunRecord

    recs = [run_case(model, "fp8", value="max"), run_case(model, "bfloat16", faults=S3),
            run_case(model, "auto", engine="limited_engines:no_kv_access")]
    assert [r.status for r in recs] == ["pass", "fail", "unsupported"]
    con = Console(record=True, width=250)
    render(RunRecord("kvdiag poison", "now", recs, {}), con)
    rows = {line.split("│")[1].strip(): [x.strip() for x in line.split("│")[2:-1]]
            for line in con.export_text().splitlines() if line.startswith("│")}
    assert rows["fp8"][:5] == ["max", str(recs[0].metrics["fresh_blocks"]), str(recs[0].metrics["poisoned_blocks"]),
                               "yes", "0"]
    assert rows["bfloat16"][3] == "no" and rows["bfloat16"][5].startswith("request 0 position 0:")
    assert rows["auto"][-1] == "unsupported" and limited_engines.NO_KV_REASON[:40] in rows["auto"][5]


def test_waves_sized_for_other_blocks_than_the_engines_are_said_under_the_table(model):
    """An engine whose blocks are its own (vLLM's MLA backend on a GPU: 64 tokens) runs waves sized for kvdiag's 16:
    still a verdict, with an info printed under the table (not in the first-difference cell); -a block_size=N sizes
    the waves for the engine's blocks, and then nothing is said."""
    from rich.console import Console

    from kvdiag.checks.poison.view import render
    from kvdiag.results import RunRecord

    own = run_case(model, "auto", engine="limited_engines:own_blocks")
    assert own.status == "pass" and own.metrics["fresh_blocks"] > 0, own.findings
    assert (own.metrics["block_size"], own.metrics["workload_block_size"]) == (limited_engines.OWN_BLOCK, 16)
    (info,) = [f for f in own.findings if f.kind == "block_size"]
    assert info.severity == "info" and "sized for blocks of 16 tokens" in info.message and "hold 32" in info.message
    con = Console(record=True, width=250)
    render(RunRecord("kvdiag poison", "now", [own], {}), con)
    text = con.export_text()
    (row,) = [line for line in text.splitlines() if line.startswith("│ auto")]
    assert "sized" not in row and f"info (auto): block_size: {info.message[:60]}" in text.replace("\n", " ")
    sized = run_case(model, "auto", engine="limited_engines:own_blocks",
                     engine_args={"block_size": limited_engines.OWN_BLOCK})
    assert sized.status == "pass" and sized.metrics["workload_block_size"] == limited_engines.OWN_BLOCK
    assert not [f for f in sized.findings if f.kind == "block_size"], sized.findings


def test_cli_bad_input_is_one_line():
    for args, needle in ((["--value", "zero"], "zero"), (["--fault", "nope"], "nope")):
        r = kvdiag("poison", *args)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and needle in r.stderr, r.stderr



def test_lengths_adds_a_wave_of_every_prompt_length_mod_the_block_and_the_clean_engine_passes(model, tmp_path):
    """`--lengths`: a fourth wave, one prompt ending at every slot of its last block (residues 0 to B-1), on blocks
    poisoned before it; the clean engine reads none of the poison."""
    r = kvdiag("poison", "-m", model, "-d", "auto", "--device", TEST_DEVICE, "--lengths", "-f", "json", "-o",
               str(tmp_path / "run"))
    assert r.returncode == 0, r.stderr
    (c,) = json.loads(r.stdout)["cases"]
    m = c["metrics"]
    block = m["workload_block_size"]
    assert c["status"] == "pass" and sorted(n % block for n in m["residue_wave_tokens"]) == list(range(block))
    assert m["kv_nonfinite"] == 0 and m["fresh_blocks"] > 0
