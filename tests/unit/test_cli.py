"""The command line as a user meets it: instant help, version, dtype listing, one-line errors."""

import json
import subprocess
import sys

from cpu_seconds import timed_run

from kvdiag import __version__


def kvdiag(*args, **kw):
    return subprocess.run([sys.executable, "-m", "kvdiag", *args], capture_output=True, text=True, **kw)


def test_help_is_instant_and_imports_no_torch():
    r, cpu = timed_run([sys.executable, "-m", "kvdiag", "--help"])
    assert r.returncode == 0
    assert "dtypes" in r.stdout
    assert cpu < 1.5, cpu  # CPU seconds, a whole interpreter start included
    probe = subprocess.run([sys.executable, "-c", "import sys; from kvdiag.cli.app import app; "
                            "print('torch' in sys.modules, 'lm_eval' in sys.modules)"],
                           capture_output=True, text=True)
    assert probe.stdout.split() == ["False", "False"]


def test_version():
    r = kvdiag("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"kvdiag {__version__}"


def test_dtypes_json_lists_the_builtin_dtypes():
    r = kvdiag("dtypes", "--format", "json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)["kv_dtypes"]
    assert [x["name"] for x in rows] == ["auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2",
                                         "int8_per_token_head", "fp8_per_token_head"]
    by = {x["name"]: x for x in rows}
    assert by["int8_per_token_head"]["bytes_per_element"] == 1 and by["bfloat16"]["bytes_per_element"] == 2
    assert by["fp8_e4m3"]["same_as"] == "fp8"


def test_dtypes_table_and_aliases():
    r = kvdiag("dtypes", "--kv-dtype", "bf16", "-d", "int8", "-d", "FP8PTH", "-f", "json")
    assert r.returncode == 0, r.stderr
    assert [x["name"] for x in json.loads(r.stdout)["kv_dtypes"]] == [
        "bfloat16", "int8_per_token_head", "fp8_per_token_head"]
    r = kvdiag("dtypes")
    assert r.returncode == 0 and "fp8_per_token_head" in r.stdout and "float8_e4m3fn" in r.stdout


def one_line_error(r, *needles):
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "Traceback" not in r.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def test_unknown_dtype_exits_2_naming_valid_choices():
    one_line_error(kvdiag("dtypes", "--kv-dtype", "int4"), "int4", "auto", "fp8_per_token_head")


def test_a_dtype_typo_gets_the_dtype_it_resembles_before_any_worker(tmp_path):
    r = kvdiag("memleak", "-d", "fp88", "-o", str(tmp_path / "r"))
    one_line_error(r, "unknown kv-cache dtype 'fp88'", "(did you mean 'fp8'?)", "valid: auto")
    assert not (tmp_path / "r").exists()
    one_line_error(kvdiag("accuracy", "-d", "int8pht"), "(did you mean 'int8_per_token_head'?)")  # an alias's name
    r = kvdiag("dtypes", "-d", "int4")
    one_line_error(r, "'int4'")
    assert "did you mean" not in r.stderr  # another bit width is no typo: int4 is not int8


def test_unknown_engine_exits_2_naming_valid_choices():
    one_line_error(kvdiag("dtypes", "--engine", "sglang"), "sglang", "builtin", "vllm")


def test_bad_option_value_and_unknown_command_exit_2():
    one_line_error(kvdiag("dtypes", "--format", "xml"), "xml")
    one_line_error(kvdiag("frobnicate"), "frobnicate")


def test_bad_limit_exits_2_before_any_worker(tmp_path):
    for bad in ("-5", "0", "2.5"):
        r = kvdiag("accuracy", "--limit", bad, "-d", "auto", "-o", str(tmp_path / bad))
        one_line_error(r, "--limit", "fraction")
        assert not (tmp_path / bad / "results.jsonl").exists()


def test_engine_args_split_like_lm_evals_model_args():
    from kvdiag.engines.args import parse_engine_args

    assert parse_engine_args(["a=1,b=2", "sizes=[1,2]", 'name="x, y"']) == {"a": 1, "b": 2, "sizes": [1, 2],
                                                                            "name": "x, y"}
