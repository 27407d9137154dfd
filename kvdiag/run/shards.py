"""A suite spread over machines: ``kvdiag ci --shard K/N`` runs a deterministic share of the suite's cases, and
``kvdiag report --merge RUN_DIR... -o OUT`` puts the shards' runs back together into one run.

A share is made of *units*: the cases one cross-case analysis judges together (accuracy's dtypes against their
baseline, the dtype matrix) and the cases that share a worker (``--isolate run``) stay in one shard. Units go to
shards round robin in suite order, or, given the durations of an earlier run (``--durations RUN_DIR``), longest
first to the shard with the least work so far (unknown units count as the mean). The same durations also start a
run's longest cases first (``kvdiag.run.runner.run_cases``), with or without shards. The same suite and the same
durations give the same shards on every machine. Every shard's run.json names the suite (a digest of all its case
ids), which ``--merge`` checks.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from kvdiag.errors import UserError


def parse_shard(text: str) -> tuple[int, int]:
    """'K/N' -> (K, N) with 1 <= K <= N."""
    k, sep, n = str(text).partition("/")
    if sep and k.strip().isdigit() and n.strip().isdigit() and 1 <= int(k) <= int(n):
        return int(k), int(n)
    raise UserError(f"--shard '{text}': give K/N with 1 <= K <= N (e.g. 1/4; Slurm: "
                    "$((SLURM_ARRAY_TASK_ID+1))/$SLURM_ARRAY_TASK_COUNT)")


def suite_id(cases: list) -> str:
    """The suite a shard belongs to: a digest of every case id of the whole suite."""
    return hashlib.sha256("\n".join(sorted(c.id for c in cases)).encode()).hexdigest()[:16]


def units(cases: list, scopes: list[set]) -> list[list]:
    """The cases in groups that must run in one shard, in suite order of their first case."""
    owner = {c.id: i for i, c in enumerate(cases)}
    parent = list(range(len(cases)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    def join(ids) -> None:
        idx = [owner[x] for x in ids if x in owner]
        for j in idx[1:]:
            parent[root(j)] = root(idx[0])

    for scope in scopes:
        join(scope)
    by_group: dict[str, list[str]] = {}
    for c in cases:
        if c.group:
            by_group.setdefault(c.group, []).append(c.id)
    for ids in by_group.values():
        join(ids)
    out: dict[int, list] = {}
    for i, c in enumerate(cases):
        out.setdefault(root(i), []).append(c)
    return sorted(out.values(), key=lambda u: owner[u[0].id])


def assign(parts: list[list], n: int, durations: dict[str, float] | None = None) -> list[int]:
    """The shard (0-based) of each unit: round robin, or by durations (longest first onto the least loaded)."""
    if not durations:
        return [i % n for i in range(len(parts))]
    cost = costs(parts, durations)
    load, out = [0.0] * n, [0] * len(parts)
    for i in longest_first(cost):
        k = min(range(n), key=lambda s: (load[s], s))
        out[i] = k
        load[k] += cost[i]
    return out


def costs(parts: list[list], durations: dict[str, float]) -> list[float]:
    """Each unit's time in an earlier run (its cases' durations summed); a case that run lacks counts as its mean."""
    known = [durations[c.id] for u in parts for c in u if c.id in durations]
    mean = sum(known) / len(known) if known else 1.0
    return [sum(durations.get(c.id, mean) for c in u) for u in parts]


def longest_first(cost: list[float]) -> list[int]:
    """The units' indices, longest first by their ``costs`` (ties in suite order)."""
    return sorted(range(len(cost)), key=lambda i: (-cost[i], i))


def select(cases: list, scopes: list[set], shard: tuple[int, int], durations: dict | None = None) -> list:
    """The cases of shard ``(K, N)``, in suite order."""
    k, n = shard
    parts = units(cases, scopes)
    mine = {c.id for u, s in zip(parts, assign(parts, n, durations)) if s == k - 1 for c in u}
    return [c for c in cases if c.id in mine]


def durations_of(run_dir: Path) -> dict[str, float]:
    """Each case's duration in an earlier run (its results.jsonl)."""
    from kvdiag.results import read_jsonl

    path = Path(run_dir) / "results.jsonl"
    if not path.is_file():
        raise UserError(f"--durations '{run_dir}': no results.jsonl there")
    return {cid: rec.duration_s for cid, rec in read_jsonl(path).items()}


# ------------------------------------------------------------------ merging


def merge(run_dirs: list[Path], out: Path):
    """One run from the shards' runs: every case record, the analyses, run.json and the report files in ``out``.
    Runs of different suites (or not shards) are refused with one line; a missing shard is a warning, and the
    merged run is incomplete: it fails (exit 1) and its reports say which shards it lacks."""
    import sys

    from kvdiag.results import RunRecord, append_jsonl, exit_code_for, load_run, summarize, write_run_json

    runs = [load_run(Path(d)) for d in run_dirs]
    first = runs[0]
    for d, r in zip(run_dirs, runs):
        if not r.shard:
            raise UserError(f"cannot merge '{d}': not a run of kvdiag ci --shard")
        if r.shard["suite"] != first.shard["suite"] or r.shard["count"] != first.shard["count"]:
            raise UserError(f"cannot merge '{d}' with '{run_dirs[0]}': different suites (suite "
                            f"{r.shard['suite']} of {r.shard['count']} shards, not {first.shard['suite']} of "
                            f"{first.shard['count']}); merge the shards of one config")
    seen = [r.shard["index"] for r in runs]
    if len(set(seen)) != len(seen):
        raise UserError(f"cannot merge: shard {max(seen, key=seen.count)}/{first.shard['count']} given twice")
    missing = sorted(set(range(1, first.shard["count"] + 1)) - set(seen))
    if missing:
        print(f"kvdiag: warning: shards {', '.join(map(str, missing))} of {first.shard['count']} missing: the merged "
              "run lacks their cases", file=sys.stderr)
    out = Path(out)
    if (out / "results.jsonl").exists():
        raise UserError(f"'{out}' already holds a run; give an empty or new folder")
    out.mkdir(parents=True, exist_ok=True)
    runs.sort(key=lambda r: r.shard["index"])  # each run keeps its own directory: r.run_dir
    cases = [c for r in runs for c in r.cases]
    for c in cases:
        append_jsonl(out / "results.jsonl", c)
    _copy_artifacts(runs, out)
    analysis = {k: v for r in runs for k, v in r.analysis.items() if k != "baseline"}
    merged = RunRecord(command=" ".join(["kvdiag report --merge", *map(str, run_dirs), "-o", str(out)]),
                       started=min(r.started for r in runs), finished=max(r.finished or r.started for r in runs),
                       cases=cases, environment={**first.environment, "shards": [
                           {"index": r.shard["index"], "run_dir": r.run_dir, "hostname": r.environment.get("hostname")}
                           for r in runs]},
                       run_dir=str(out), analysis=analysis, models={k: v for r in runs for k, v in r.models.items()},
                       shard={"suite": first.shard["suite"], "count": first.shard["count"], "merged": sorted(seen),
                              "missing": missing})
    merged.summary = summarize(cases)
    merged.exit_code = max([exit_code_for(cases), int(bool(missing))] + [r.exit_code or 0 for r in runs])
    write_run_json(out, merged)
    return merged


def _copy_artifacts(runs, out: Path) -> None:
    """Artifacts and logs of every shard (their names carry the case ids: no clashes)."""
    import shutil

    for r in runs:
        for sub in ("artifacts", "logs"):
            src = Path(r.run_dir) / sub
            if src.is_dir():
                shutil.copytree(src, out / sub, dirs_exist_ok=True)


def shard_record(cases_all: list, shard: tuple[int, int] | None, durations_from: Path | None) -> dict:
    """What run.json says of the shard."""
    if shard is None:
        return {}
    return {"suite": suite_id(cases_all), "index": shard[0], "count": shard[1],
            "balanced_by": str(durations_from) if durations_from else "round robin"}
