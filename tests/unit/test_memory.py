"""kvdiag.measure.memory: census, survivors, snapshots; kvdiag.measure.holders: who holds what survived."""

import gc

import memleak_fakes as fakes
import pytest
import torch

from kvdiag.measure.holders import FROZEN, holders
from kvdiag.measure.memory import MiB, snapshot, survivors, take_census

SIZES = {"global": 1 << 20, "model": 64, "class": 1 << 18, "closure": 1 << 16}  # float32 elements


@pytest.fixture
def planted():
    fakes.clear()
    gc.collect()
    base = take_census()
    fakes.fill(SIZES)
    yield base
    fakes.clear()


def test_census_counts_each_storage_once_and_by_device():
    base = take_census()
    t = torch.zeros(1000, 100)  # 400,000 bytes
    views = [t[1:], t.view(-1), t.t()]
    now = take_census()
    assert now.count - base.count == 4
    assert now.bytes - base.bytes == 400_000  # views share the storage
    assert now.by_device()["cpu"]["bytes"] - base.by_device().get("cpu", {"bytes": 0})["bytes"] == 400_000
    del t, views


def test_survivors_are_new_storages_above_the_floor():
    kept = [torch.zeros(10)]
    base = take_census()
    kept += [torch.zeros(10_000), torch.zeros(100), kept[0][2:]]  # large, small, a view of a baseline tensor
    s = survivors(base, take_census())
    assert (s.count, s.bytes, s.small_count, s.small_bytes) == (1, 40_000, 1, 400)
    assert s.by_device == {"cpu": 40_000}
    del kept


def test_holders_name_global_lru_key_closure_and_class_attribute_ranked_by_bytes(planted):
    s = survivors(planted, take_census(), floor=1)
    found = holders(s.keys)
    names = [h.holder for h in found]
    assert names[0] == "module global memleak_fakes.GLOBAL_LIST"  # 4 MiB, the largest first
    assert found[0].bytes == 4 * MiB and found[0].path == "memleak_fakes.GLOBAL_LIST[0]"
    assert names[1] == "class attribute memleak_fakes.Registry.scales"
    assert names[2] == "closure of memleak_fakes.make_closure.<locals>.reader (variable t)"
    lru = found[3]
    assert lru.holder == ("lru_cache memleak_fakes.cached_by_method "
                          "(key holds bound method Model.forward of <Model>)")
    assert lru.path.endswith(".__self__.layers[0].weight") or lru.path.endswith(".__self__.layers[1].weight")
    assert lru.count == 4 and lru.tensors == 4  # two Linear layers: weight + bias each
    assert [h.bytes for h in found] == sorted((h.bytes for h in found), reverse=True)
    assert any("bound method Model.forward" in step for step in lru.chain)


def test_engine_object_named_as_root():
    base = take_census()
    engine = fakes.LeakyEngine()
    engine.start(None)
    engine.shutdown()
    found = holders(survivors(base, take_census()).keys, {id(engine): "the engine object after shutdown()"})
    assert [(h.holder, h.path, h.bytes) for h in found] == [("the engine object after shutdown()", "LeakyEngine.kv",
                                                              1 << 20)]
    del engine


def test_tensor_held_only_by_a_frozen_container_is_invisible_frozen():
    box = {"tracked": []}  # an empty dict is not even tracked by gc; this one is, and gets frozen
    base = take_census()
    gc.freeze()
    try:
        box["t"] = torch.zeros(1 << 16)  # the dict is frozen: gc.get_referrers cannot see it
        found = holders(survivors(base, take_census()).keys)
        assert [h.holder for h in found] == [FROZEN]
        assert found[0].bytes == 1 << 18
    finally:
        gc.unfreeze()
    del box


def test_local_variable_of_a_live_frame():
    base = take_census()
    t = torch.zeros(1 << 14)
    held = holders(survivors(base, take_census()).keys)
    assert held[0].holder.startswith("local variable t of test_local_variable_of_a_live_frame")
    del t


def test_snapshot_on_cpu_leaves_cuda_columns_empty():
    snap = snapshot("baseline", 0, cuda=False)
    row = snap.row()
    assert row["rss_mib"] > 10 and row["frozen"] == gc.get_freeze_count()
    assert [row[k] for k in ("cuda_allocated_mib", "cuda_reserved_mib", "driver_used_mib", "nvml_process_mib")] \
        == [None] * 4


def test_torch_compiles_fake_tensors_hold_no_memory_and_are_named_in_a_chain(tmp_path):
    """A compiled vLLM model keeps FakeTensors (dynamo's, sizes possibly symbolic) alive beside real ones: they own
    no device memory, so the census leaves them out, and a holder chain through one still prints (a compiled Qwen3
    memleak case's chain formats such a size)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from kvdiag.measure.holders import short

    before = take_census()
    with FakeTensorMode():
        fake = torch.empty(1024, 1024)
    real = torch.empty(1024, 1024)
    s = survivors(before, take_census())
    assert s.count == 1 and s.bytes == real.untyped_storage().nbytes()
    assert short(fake) == "FakeTensor[1024x1024] float32 cpu" and "storage 4 MiB" in short(real)
