"""`--resume RUN_DIR`: the run goes on with its own command and options, never with today's defaults.

run.json records the call that made the run (``call``: the check, engine, model, kv dtypes, device, engine
arguments, faults, isolation and the check's options, as the command gave them) and its plan (``plan``: each case's
id and a hash of what it runs with). A resumed run takes the recorded call; an option given again must equal the
recorded one (else one line, exit 2, before any worker starts), and the cases it builds must be the recorded plan's.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from kvdiag.errors import UserError

# the options of every check command, as run_check names them, and their flags (for the one line)
FLAGS = {"engine": "--engine", "model": "--model", "kv_dtypes": "--kv-dtype", "device": "--device",
         "engine_args": "-a", "faults": "--fault", "isolate": "--isolate"}


def jsonable(value):
    """``value`` as run.json holds it (Enums by their value, paths as text), so that a call compares equal to the
    call read back."""
    return json.loads(json.dumps(value, default=lambda v: getattr(v, "value", str(v))))


def recorded(run_dir: Path) -> dict:
    """The run.json of a run directory to resume (UserError where there is none to read)."""
    path = Path(run_dir) / "run.json"
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UserError(f"--resume: {path} cannot be read ({e.__class__.__name__}): nothing says what the run "
                        "was") from None


def resumed_call(run_dir: Path, call: dict, given: set[str], flag_of) -> dict:
    """The call the run in ``run_dir`` was made with. ``call``: this command's; ``given``: the names of the
    options given again (each must equal the recorded value); ``flag_of(name)``: an option's flag for the message."""
    prev = recorded(run_dir).get("call")
    if prev is None:
        raise UserError(f"--resume: {run_dir}/run.json records no options (a run of an earlier kvdiag, or of "
                        "`kvdiag ci`): run it again in a new directory")
    if prev.get("check") != call["check"]:
        raise UserError(f"--resume: {run_dir} is a run of '{prev.get('check')}', not of '{call['check']}'")
    now = jsonable(call)
    old = {**prev, **prev.get("options", {})}
    mine = {**now, **now.get("options", {})}
    for name in sorted(given):
        if name in mine and _same(mine[name]) != _same(old.get(name)):
            raise UserError(f"--resume: {flag_of(name)} {_said(mine[name])} differs from the run's "
                            f"{_said(old.get(name))}; a resumed run keeps its options (a new run: -o NEW_DIR)")
    return prev


def _same(value):
    """A value as compared: a list in any order (-d fp8 -d auto is the run's -d auto -d fp8)."""
    return sorted(map(json.dumps, value)) if isinstance(value, list) else value


def _said(value) -> str:
    if value is None:
        return "default"
    if isinstance(value, list):
        return ",".join(map(str, value)) or "none"
    return str(value)


def plan(cases: list) -> list[list[str]]:
    """[id, hash of what the case runs with] per case, in the run's order."""
    out = []
    for c in cases:
        what = jsonable({"engine": c.engine, "model": c.model, "kv_dtype": c.kv_dtype, "target": c.target,
                         "params": c.params})
        out.append([c.id, hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]])
    return out


def same_plan(run_dir: Path, cases: list) -> list[list[str]]:
    """This run's plan, where it is the recorded run's (UserError naming the first case that differs: a case
    added, missing, or run with other arguments). A run.json without a plan (an earlier kvdiag's) is not held."""
    mine = plan(cases)
    prev = recorded(run_dir).get("plan") if (Path(run_dir) / "run.json").exists() else None  # results.jsonl alone
    if prev is None or prev == mine:
        return mine
    old, new = dict(map(tuple, prev)), dict(map(tuple, mine))
    added = [i for i in new if i not in old]
    missing = [i for i in old if i not in new]
    changed = [i for i in new if i in old and new[i] != old[i]]
    what = (f"adds case {added[0]}" if added else f"lacks case {missing[0]}" if missing
            else f"runs case {changed[0]} with other arguments")
    raise UserError(f"--resume: this command {what} ({len(added)} added, {len(missing)} missing, {len(changed)} "
                    f"changed against {run_dir}); a resumed run has exactly the run's cases")
