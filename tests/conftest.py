"""Shared test setup: offline hub, few threads, and cached random-weight checkpoints."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
for _var in ("COLUMNS", "LINES"):  # set for child processes by readline (which pytest imports), not by the user:
    if _var not in os.environ:  # kvdiag's tables honour COLUMNS, and a test's kvdiag should see the shell's width
        os.unsetenv(_var)

import pytest  # noqa: E402

try:
    import torch

    # one thread: on a shared 2-core machine two OpenMP threads often run 10-30x slower
    torch.set_num_threads(int(os.environ.get("KVDIAG_TEST_THREADS", "1")))
except ImportError:  # pragma: no cover
    pass

# KVDIAG_TEST_DEVICE=cuda runs the engine/kernel tests on the GPU
TEST_DEVICE = os.environ.get("KVDIAG_TEST_DEVICE", "cpu")


@pytest.fixture(scope="session")
def random_model(tmp_path_factory):
    """``random_model(arch, **kw)`` -> path of a random checkpoint (kvdiag.modelgen), built once per kwargs."""
    from kvdiag.modelgen import make_random_model

    made = {}

    def make(arch="llama", **kw):
        key = (arch, tuple(sorted((k, repr(v)) for k, v in kw.items())))
        if key not in made:
            made[key] = make_random_model(tmp_path_factory.mktemp(arch), arch, **kw)
        return str(made[key])

    return make
