"""One final record per case: a case whose verdict the run decides after it ran (accuracy and dtypes against the
baseline dtype, paths against its reference case) is said as "ran (judged at the end)" while the run goes on, never
as the pass it may not be, and results.jsonl ends with exactly one record per case, the verdict."""

from __future__ import annotations

import json

from kvdiag.case import Case


def sweep(check: str) -> list[Case]:
    return [Case(check, "builtin", "m", d, "case_fns:healthy", params={"device": "cpu"}, id=f"{check}/{d}")
            for d in ("auto", "fp8", "int8")]


def lines(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def flip_fp8(run) -> None:
    """An analysis across cases, as accuracy's: fp8 drifted from the baseline."""
    for c in run.cases:
        if c.kv_dtype == "fp8":
            c.status = "fail"
            c.add("error", "drift", "fp8 drifted")


def test_a_case_judged_at_the_end_is_said_as_ran_and_recorded_once_with_its_verdict(tmp_path, capsys):
    from kvdiag.run.orchestrate import record

    run = record(sweep("accuracy"), tmp_path, timeout=60, analyze=flip_fp8)
    err = capsys.readouterr().err
    done = [x for x in err.splitlines() if "done)" in x]
    assert len(done) == 3 and all(": ran (judged at the end) (" in x for x in done), err
    judged = sorted(x for x in err.splitlines() if x.endswith(" (judged at the end)"))  # then each one's verdict
    assert [x.split("] ", 1)[1] for x in judged] == ["accuracy/auto: pass (judged at the end)",
                                                     "accuracy/fp8: fail (judged at the end)",
                                                     "accuracy/int8: pass (judged at the end)"], err
    assert err.index("accuracy/fp8: fail") > max(err.index(x) for x in done)
    recs = lines(tmp_path / "results.jsonl")
    assert [r["id"] for r in recs] == [c.id for c in run.cases]  # one each, in the run's order
    assert {r["id"]: r["status"] for r in recs} == {"accuracy/auto": "pass", "accuracy/fp8": "fail",
                                                    "accuracy/int8": "pass"}
    assert not any("judged_later" in r["metrics"] for r in recs)
    assert run.exit_code == 1


def test_a_run_cut_short_before_its_judgement_marks_its_records_as_not_yet_verdicts(tmp_path, capsys):
    from kvdiag.results import read_jsonl
    from kvdiag.run.runner import run_cases

    run_cases(sweep("dtypes"), tmp_path, quiet=True, timeout=60)  # what a killed kvdiag left: the workers' records
    recs = lines(tmp_path / "results.jsonl")
    assert len(recs) == 3 and all(r["metrics"]["judged_later"] is True for r in recs)
    assert all(r.metrics["judged_later"] for r in read_jsonl(tmp_path / "results.jsonl").values())


def test_a_check_without_a_judgement_across_cases_says_its_verdict_at_once(tmp_path, capsys):
    from kvdiag.run.orchestrate import record

    record(sweep("memleak"), tmp_path, timeout=60)
    err = capsys.readouterr().err
    assert sum(": pass (" in x for x in err.splitlines()) == 3, err
    assert [r["status"] for r in lines(tmp_path / "results.jsonl")] == ["pass"] * 3


def test_a_case_that_says_nothing_is_said_to_run_every_progress_interval_with_its_stage(tmp_path, capsys,
                                                                                        monkeypatch):
    """A long engine start, a drift probe: no document moves, and still a line comes every KVDIAG_PROGRESS_S."""
    from kvdiag.run import progress
    from kvdiag.run.runner import run_cases

    monkeypatch.setattr(progress, "PROGRESS_S", 0.5)
    case = Case("memleak", "builtin", "m", "auto", "case_fns:silent_stage", params={"sleep": 2.5}, id="m/auto")
    (rec,) = run_cases([case], tmp_path, timeout=60)
    lines = [x for x in capsys.readouterr().err.splitlines() if x.strip().startswith("m/auto: running ")]
    assert rec.status == "pass" and len(lines) >= 3 and all(x.endswith(", in engine start") for x in lines), lines
    seconds = [int(x.split("running ")[1].split(" s")[0]) for x in lines]
    assert seconds == sorted(seconds) and seconds[-1] >= 2, lines
