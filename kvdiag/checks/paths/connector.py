"""The ``kv-connector`` path: a request's K/V stored through a KV connector by one engine and loaded by another, in
a fresh process, as prefill/decode disaggregation and external KV stores move it.

The case's worker starts its engine with the connector (the loading side; vLLM: ``ExampleConnector``, ``kv_both``,
files under a directory of this case; the builtin engine: ``-a kv_connector_dir``). Then a second engine of the same
arguments runs the prompts in a process of its own (``python -m kvdiag.checks.paths.connector``), which stores each
prompt's full blocks through the connector and exits; then the worker's engine runs the same prompts, reading those
blocks from the connector instead of computing them. Its outputs are held to the cold reference case
(``verdict.analyze``); its counter, ``connector_loaded_tokens``, says how many prompt tokens it loaded. The storing
engine computes every token itself: its outputs against the cold run are a fresh engine's own difference, which
the floor takes (a compiled vLLM differs there as much as the load does: docs/vllm-gpu-results.md, kv-connector).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

from kvdiag.checks.common import WorkloadFailed
from kvdiag.checks.paths.engine_runs import TOP, Trial, counted_run, counter, reset

PATH = "kv-connector"
STORE_TIMEOUT_S = 900  # an engine start, compiled on a fresh machine, and one generate
_DIRS: dict[int, str] = {}  # each case's store directory (by the case object: cases may share a worker, in threads)


def need(case, path: str) -> dict:
    """For the kv-connector path, the directory its engines store to and load from (``connector_dir``, as
    ``EngineTraits.path_config`` reads it), one per case (another kv dtype's K/V must never be found there); {} for
    any other path."""
    if path != PATH:
        return {}
    if id(case) not in _DIRS:
        _DIRS[id(case)] = tempfile.mkdtemp(prefix="kvdiag-kv-connector-")
    return {"connector_dir": _DIRS[id(case)]}


def cleanup(case) -> None:
    """Remove the case's store directory, if it has one."""
    if id(case) in _DIRS:
        shutil.rmtree(_DIRS.pop(id(case)), ignore_errors=True)


def run(case, spec, engine, prompts, max_tokens: int, path) -> Trial:
    """The prompts stored by an engine of ``spec`` in a process of its own, then run by ``engine`` (the worker's,
    started with the same ``spec``), which loads what was stored. The store's outcome is in the notes:
    ``stored_prompts`` (entries in the store directory) and its seconds; and ``read_as_cached``, the prompt tokens the
    engine says it did not compute in the loading run (its ``prefix_hit_tokens``), beside the path's counter."""
    store = _store(case, spec, prompts, max_tokens)
    reset(engine)  # nothing of the worker's own cache may serve the run: only the connector
    before = counter(engine, "prefix_hit_tokens")
    out, counted = counted_run(engine, prompts, max_tokens, path.counter, "connector load")
    after = counter(engine, "prefix_hit_tokens")
    if after is not None:  # vLLM: RequestOutput.num_cached_tokens, local and external (nothing local after the reset)
        store["read_as_cached"] = after - (before or 0)
    return Trial(None, out, counted, store)


def _store(case, spec, prompts, max_tokens: int) -> dict:
    from dataclasses import asdict

    directory = need(case, PATH)["connector_dir"]
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"engine": case.engine, "spec": asdict(spec), "prompts": [list(map(int, q)) for q in prompts],
                   "max_tokens": max_tokens}, f)
    try:
        p = subprocess.run([sys.executable, "-m", "kvdiag.checks.paths.connector", f.name], capture_output=True,
                           text=True, timeout=STORE_TIMEOUT_S, stdin=subprocess.DEVNULL, env=dict(os.environ))
    except subprocess.TimeoutExpired:
        raise WorkloadFailed("connector store") from RuntimeError(f"the storing engine gave no answer in "
                                                                  f"{STORE_TIMEOUT_S} s")
    finally:
        os.unlink(f.name)
    said = _last_json(p.stdout)
    if p.returncode != 0 or said is None or "error" in said:
        from kvdiag.death import cause

        line = (said or {}).get("error") or cause(p.stdout + "\n" + p.stderr).line or f"exit status {p.returncode}"
        raise WorkloadFailed("connector store (the storing engine's process)") from RuntimeError(line)
    return {"stored_prompts": len(os.listdir(directory)), "store_seconds": said["seconds"],
            "store_completions": said["completions"]}


def _last_json(text: str) -> dict | None:
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                return None
    return None


def _child(job_file: str) -> int:
    """The storing engine's process: start the engine, run the prompts greedily (the connector stores their
    blocks), shut down; one JSON line on stdout."""
    import time

    from kvdiag.engines.base import create_engine
    from kvdiag.engines.protocol import EngineSpec

    with open(job_file) as f:
        job = json.load(f)
    from kvdiag.checks.paths.completions import to_json

    t = time.perf_counter()
    spec = dict(job["spec"])
    spec["faults"] = tuple(spec.get("faults") or ())
    engine = create_engine(job["engine"])
    try:
        engine.start(EngineSpec(**spec))
        out = engine.generate(job["prompts"], job["max_tokens"], greedy=True, logprobs=TOP)
        engine.shutdown()
    except Exception as e:  # noqa: BLE001 - said to the worker, which records the case's failure
        from kvdiag.errors import first_line

        print(json.dumps({"error": f"{type(e).__name__}: {first_line(e)}"}), flush=True)
        return 1
    print(json.dumps({"seconds": round(time.perf_counter() - t, 1), "completions": to_json(out)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1]))
