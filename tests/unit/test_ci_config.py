"""`kvdiag ci` config: a mistake exits 2 with one line naming the file and line; the shipped config is valid."""

from pathlib import Path

import pytest

from kvdiag.cli.app import main

REPO = Path(__file__).resolve().parents[2]


def run_cli(capsys, *args) -> tuple[int, str]:
    with pytest.raises(SystemExit) as e:
        main(list(args))
    err = capsys.readouterr().err
    return e.value.code, err


@pytest.mark.parametrize("text, line, words", [
    ('kv_dtypes = ["auto"]\n[memleak]\ncycles = 2\nbogus = 1\n', 4,
     ["unknown key 'bogus' in [memleak]", "threshold_mib"]),
    ('kv_dtypes = ["auto"]\n\n[memleak]\ncycles = "two"\n', 4, ["'cycles'", "expected an integer >= 1"]),
    ('kv_dtypes = ["auto"]\n[wake-cycle]\nlevels = [1, 3]\n', 3, ["'levels'", "one of 1, 2"]),
    ('kv_dtypes = ["auto"\n[memleak]\n', 2, ["bad TOML"]),
    ('[memleak]\ncycles = 1\nkv_dtypes = [\n', 3, ["bad TOML", "the file ends inside it"]),
    ('kv_dtypes = ["auto"]\n[memleak]\nkv_dtypes = ["fp8", "fp9"]\n', 3, ["unknown kv-cache dtype 'fp9'", "fp8_e5m2"]),
    ('kv_dtypes = ["fp9"]\n[memleak]\ncycles = 1\n', 1, ["unknown kv-cache dtype 'fp9'"]),
    ('speed = 3\n[memleak]\n', 1, ["unknown key 'speed'", "kv_dtypes"]),
    ('kv_dtypes = ["auto"]\n[accuracy]\nlimit = 5\nbaseline = "fp9"\n', 4, ["--baseline: unknown kv-cache dtype"]),
    ('kv_dtypes = ["auto"]\n[accuracy]\ndrift_decoded = -8\n', 3, ["'drift_decoded'", "an integer >= 0"]),
    ('output_dir = "out/x"\n[memleak]\ncycles = 1\n', 1, ["output directory", "not writable"]),
    ('kv_dtypes = ["auto"]\n', None, ["no check to run"]),
])
def test_bad_config_exits_2_with_file_and_line(tmp_path, capsys, text, line, words):
    (tmp_path / "out").write_text("a file where the run directory's parent should be")
    cfg = tmp_path / "kvdiag.toml"
    cfg.write_text(text)
    code, err = run_cli(capsys, "ci", "--config", str(cfg))
    assert code == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"kvdiag: error: {cfg}" + (f":{line}: " if line else ": ")), err
    for w in words:
        assert w in err, err


def test_pyproject_tool_table_is_read_with_its_lines(tmp_path, capsys):
    py = tmp_path / "pyproject.toml"
    py.write_text('[project]\nname = "x"\n\n[tool.kvdiag]\nkv_dtypes = ["auto"]\n\n[tool.kvdiag.memleak]\n'
                  'cycles = 0\n')
    code, err = run_cli(capsys, "ci", "--config", str(py))
    assert code == 2 and err.startswith(f"kvdiag: error: {py}:8: 'cycles' = 0: expected an integer >= 1"), err


def test_shipped_config_builds_cases_for_every_check():
    from kvdiag.ci.config import load_config
    from kvdiag.ci.suite import build_suite

    cfg = load_config(REPO / "kvdiag.toml")
    cases, analyzers = build_suite(cfg)
    checks = {c.check for c in cases}
    assert checks == {"memleak", "accuracy", "wake-cycle", "poison", "paths"}
    acc = [c for c in cases if c.check == "accuracy"]
    assert acc[0].kv_dtype == "auto" and acc[0].params["role"] == "baseline" and len(analyzers) == 2  # + paths'
    assert [c.params["path"] for c in cases if c.check == "paths"] == [  # its reference case first
        "cold", "prefix-hit", "prefix-partial", "prefix-reset", "preemption", "chunked-prefill"]
    assert {c.id for c in cases if c.check == "wake-cycle"} == {
        f"wake-cycle/builtin/tiny-llama/{d}/L{lv}" for d in ("auto", "fp8") for lv in (1, 2)}
    assert all(c.timeout == 600 for c in cases)
    assert len({c.id for c in cases}) == len(cases)


def test_config_is_found_in_the_current_folder(tmp_path, monkeypatch, capsys):
    from kvdiag.ci.config import find_config

    monkeypatch.chdir(tmp_path)
    code, err = run_cli(capsys, "ci")
    assert code == 2 and "no config" in err and err.count("\n") == 1
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "x"\n')
    assert run_cli(capsys, "ci")[0] == 2
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "x"\n[tool.kvdiag.memleak]\ncycles = 1\n')
    assert find_config() == Path("pyproject.toml")
    (tmp_path / "kvdiag.toml").write_text("[memleak]\n")
    assert find_config() == Path("kvdiag.toml")


def test_the_configs_output_dir_is_for_new_runs_and_resume_goes_on_in_its_own(tmp_path):
    """`kvdiag ci --config kvdiag.toml --resume RUN_DIR` (docs/ci.md) with the repository's kvdiag.toml, whose
    output_dir is reports/ci: the run goes on in RUN_DIR; an --output-dir that is not RUN_DIR is still refused."""
    from kvdiag.ci.config import load_config
    from kvdiag.cli.ci_cmd import _run_dir
    from kvdiag.errors import UserError

    cfg = tmp_path / "kvdiag.toml"
    cfg.write_text('output_dir = "reports/ci"\n[memleak]\ncycles = 1\n')
    config = load_config(cfg)
    assert _run_dir(config, None, None) == tmp_path / "reports" / "ci"
    (tmp_path / "earlier").mkdir()
    assert _run_dir(config, None, tmp_path / "earlier") == tmp_path / "earlier"
    with pytest.raises(UserError, match="a resumed run stays in its directory"):
        _run_dir(config, tmp_path / "elsewhere", tmp_path / "earlier")


def test_bad_baseline_exits_2_before_anything_runs(tmp_path, capsys):
    cfg = tmp_path / "kvdiag.toml"
    cfg.write_text('kv_dtypes = ["auto"]\nbaseline = "missing.json"\n[memleak]\n')
    code, err = run_cli(capsys, "ci", "--config", str(cfg), "-o", str(tmp_path / "run"))
    assert code == 2 and err.startswith(f"kvdiag: error: {cfg}:2: baseline not found"), err
    (tmp_path / "bad.json").write_text('{"cases": []}')
    code, err = run_cli(capsys, "ci", "--config", str(cfg), "-o", str(tmp_path / "run"), "--baseline",
                        str(tmp_path / "bad.json"))
    assert code == 2 and "not a kvdiag baseline" in err and err.count("\n") == 1, err
    code, err = run_cli(capsys, "compare", str(tmp_path / "bad.json"), str(tmp_path))
    assert code == 2 and "not a kvdiag baseline" in err, err
    assert not (tmp_path / "run").exists()


def test_several_models_get_their_own_groups_and_analyses(tmp_path):
    import shutil

    from kvdiag.assets import TINY_MODEL
    from kvdiag.ci.config import load_config
    from kvdiag.ci.suite import build_suite

    shutil.copytree(TINY_MODEL, tmp_path / "other")
    cfg = tmp_path / "kvdiag.toml"
    cfg.write_text('models = ["tiny-llama", "other"]\nkv_dtypes = ["auto", "fp8"]\nisolate = "run"\n'
                   '[accuracy]\ntasks = ["kv_recall"]\n[dtypes]\nengines = ["builtin"]\n[poison]\ntimeout = 30\n')
    cases, analyzers = build_suite(load_config(cfg))
    assert len(cases) == 3 * 2 * 2 and len(analyzers) == 4  # accuracy and dtypes, per model
    groups = {c.group for c in cases}
    assert groups == {f"{chk}/builtin/{m}" for chk in ("accuracy", "dtypes", "poison") for m in ("tiny-llama", "other")}
    assert {c.model for c in cases} == {str(TINY_MODEL), str(tmp_path / "other")}
    assert [c.timeout for c in cases if c.check == "poison"] == [30] * 4


def test_the_zoo_gpu_suites_load_and_cover_every_family_in_both_modes(tmp_path, monkeypatch):
    """scripts/zoo-gpu/*.toml, the GPU matrix of docs/zoo.md: each loads; together every check on every zoo family,
    eager and with vLLM's defaults; the shared ones hold only checks that may share a GPU."""
    from kvdiag.checks.registry import get
    from kvdiag.ci.config import load_config
    from kvdiag.ci.suite import build_suite
    from kvdiag.models import zoo

    monkeypatch.setenv("KVDIAG_ZOO_DIR", str(tmp_path))
    real_build = zoo.build
    monkeypatch.setattr(zoo, "build", lambda *a, **k: real_build(*a, **{**k, "tiny": True}))
    seen = {}
    for path in sorted((Path(__file__).resolve().parents[2] / "scripts" / "zoo-gpu").glob("*.toml")):
        cases, _ = build_suite(load_config(path))
        eager = {bool((c.params.get("engine_args") or {}).get("enforce_eager")) for c in cases}
        assert len(eager) == 1 and eager == {"eager" in path.stem}, path
        assert all(bool(get(c.check).gpu_share) == path.stem.startswith("shared") for c in cases), path
        for c in cases:
            seen.setdefault(path.stem.split("-")[1], set()).add((c.check, Path(c.model).name.removesuffix("-random")))
    families = set(zoo.names()) - {"llama"}
    for mode in ("eager", "compiled"):
        assert {m for _, m in seen[mode]} == families, mode
        assert {k for k, _ in seen[mode]} == {"accuracy", "dtypes", "memleak", "wake-cycle", "poison"}, mode


def test_a_config_without_jobs_takes_every_commands_default_on_its_cases(tmp_path, monkeypatch, capsys, gpus):
    """A `kvdiag ci` suite of accuracy and dtypes cases must not run one case at a time where `kvdiag accuracy`
    runs many at once: a config that names no `jobs` takes the same default as the commands
    (scheduling.gpu_jobs: as many as share the GPU), and one that names it keeps it."""
    import kvdiag.run.orchestrate as orchestrate
    from kvdiag.ci.config import load_config

    seen = []
    monkeypatch.setattr(orchestrate, "execute", lambda *a, jobs, **k: seen.append(jobs) or 0)
    monkeypatch.setattr("kvdiag.run.scheduling.per_gpu", lambda cases: 8)
    monkeypatch.setattr("os.cpu_count", lambda: 16)
    gpus(1)
    body = 'engines = ["builtin"]\ndevice = "cuda"\nkv_dtypes = ["auto", "fp8", "int8"]\n[dtypes]\nenabled = true\n'
    for extra, jobs in (("", 3), ("jobs = 2\n", 2)):
        (tmp_path / "k.toml").write_text(extra + body)
        assert load_config(tmp_path / "k.toml").jobs == (jobs if extra else None)
        code, err = run_cli(capsys, "ci", "-c", str(tmp_path / "k.toml"), "-o", str(tmp_path / f"r{jobs}"))
        assert code == 0, err
    assert seen == [3, 2]
