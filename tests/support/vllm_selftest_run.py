"""``kvdiag selftest -e vllm`` of the vLLM faults CI runs, each fault's intended check only, from kvdiag's wheel
(tests/support/installed.py): run once per session by tests/conftest.py's ``vllm_selftest`` for the modules that
read it (tests/integration/test_vllm_fault_probe.py holds every fault's row to a plain vLLM script;
tests/integration/test_vllm_faults.py reads the S1 fault's dtypes analyses)."""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

# Path faults but one, whose probes (an engine per path) and self-test verdicts are nightly:
# tests/integration/test_vllm_path_faults.py's, the connector's test_vllm_connector.py's, and the split leak's
# test_vllm_split_leak.py's. CI keeps prefix_hit_block_dropped: the vLLM paths check's one run in CI.
ELSEWHERE = ("chunk_boundary_token_skipped", "spec_rejected_tokens_kept", "swa_frees_window_block",
             "offload_load_block_shifted", "evicted_block_keeps_hash", "preempt_keeps_computed_tokens",
             "connector_load_layer_shifted", "per_layer_side_buffers_kept_after_shutdown")


def names() -> tuple[str, ...]:
    from kvdiag.engines.vllm.selftest import CATALOGUE

    return tuple(n for n in CATALOGUE.names if n not in ELSEWHERE)


@dataclass(frozen=True)
class SelftestRun:
    process: subprocess.CompletedProcess
    run: dict  # the run record (-f json)

    @property
    def analysis(self) -> dict:
        return self.run["analysis"]["selftest"]

    def rows(self) -> dict:
        """fault -> its matrix row."""
        return {r["fault"]: r for r in self.analysis["faults"]}


def run(installed, out: Path) -> SelftestRun:
    from kvdiag.engines.vllm.selftest import CATALOGUE

    checks = ",".join(dict.fromkeys(CATALOGUE.fault(n).intended for n in names()))
    p = installed.run("selftest", "-e", "vllm", "--check", checks, "--fault", ",".join(names()), "-f", "json",
                      "--quiet", "-o", str(out / "run"), timeout=1800)
    assert p.returncode in (0, 1), p.stderr[-3000:]
    return SelftestRun(p, json.loads(p.stdout))
