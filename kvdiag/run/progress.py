"""Progress of a sweep on stderr: a plain line per case start and end (CI logs, pipes), or a bar with a line per
finished case on a terminal (``rich``)."""

from __future__ import annotations

import os
import sys
import time
from typing import TYPE_CHECKING

from kvdiag.case import PROGRESS_S
from kvdiag.results import CaseResult

if TYPE_CHECKING:
    from kvdiag.case import Case


class Progress:
    """Plain progress lines on stderr (CI logs); RichProgress draws a bar on a terminal."""

    def __init__(self, total: int, quiet: bool = False):
        self.total, self.done, self.started, self.quiet = total, 0, 0, quiet
        self.number: dict[str, int] = {}  # case id -> its [k/N], the same on its start and its done line
        self.said: dict[str, float] = {}  # running case id -> when a line last said something of it

    def _number(self, case_id: str) -> int:
        if case_id not in self.number:
            self.started += 1
            self.number[case_id] = self.started
        return self.number[case_id]

    def start(self, case: Case) -> None:
        k = self._number(case.id)
        self.said[case.id] = time.monotonic()
        if not self.quiet:
            print(f"[{k}/{self.total}] {case.id} ...", file=sys.stderr, flush=True)

    def finish(self, rec: CaseResult) -> None:
        self.done += 1
        self.said.pop(rec.id, None)
        k = self._number(rec.id)  # a case that never started (not run) gets the next number
        if not self.quiet:
            print(f"[{k}/{self.total}] {rec.id}: {shown(rec)} ({rec.duration_s:.1f}s{rate(rec)}; "
                  f"{self.done}/{self.total} done)", file=sys.stderr, flush=True)

    def note(self, case_id: str, text: str) -> None:
        """Progress inside a running case."""
        self.said[case_id] = time.monotonic()
        if not self.quiet:
            print(f"      {case_id}: {text}", file=sys.stderr, flush=True)

    def unsaid(self, case_id: str) -> bool:
        """Whether nothing was said of a running case for PROGRESS_S: it is due a line (``still``)."""
        return case_id in self.said and time.monotonic() - self.said[case_id] >= PROGRESS_S

    def still(self, case_id: str, seconds: float, stage: str | None) -> None:
        """A running case that said nothing for PROGRESS_S (an engine start, a drift probe, a long step): that it
        runs, for how long, and in which stage."""
        self.note(case_id, f"running {seconds:.0f} s" + (f", in {stage}" if stage else ""))

    def expect(self, total: int) -> None:
        """The cases this run will report (those a --resume did not find recorded)."""
        self.total = total

    def judged(self, rec: CaseResult) -> None:
        """A case said as "ran (judged at the end)", now judged: its verdict, under its number (a case recorded by
        an earlier run that --resume continues was not said here, and is not now)."""
        if not self.quiet and rec.id in self.number:
            print(f"[{self._number(rec.id)}/{self.total}] {rec.id}: {rec.status} (judged at the end)", file=sys.stderr,
                  flush=True)

    def close(self) -> None:
        pass


def shown(rec: CaseResult) -> str:
    """The status a finished case is said with: a case judged only once the run ends (against its baseline dtype or
    its reference case: ``judged_later``) is not yet a pass, nor an unsupported."""
    if rec.metrics.get("judged_later"):
        return "ran (judged at the end)"
    return rec.status


def rate(rec: CaseResult) -> str:
    """", 400 documents at 35.1/s" for a case that scored documents."""
    docs, per_s = rec.metrics.get("documents"), rec.metrics.get("documents_per_s")
    return f", {docs:,} documents at {per_s:.1f}/s" if docs and per_s else ""


class RichProgress(Progress):
    def __init__(self, total: int, quiet: bool = False):
        super().__init__(total, quiet)
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
        from rich.progress import Progress as RP

        self.console = Console(stderr=True)
        self.rp = RP(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                     console=self.console, transient=False)
        self.task = self.rp.add_task("starting", total=total)
        self.rp.start()

    def start(self, case: Case) -> None:
        self.said[case.id] = time.monotonic()
        self.rp.update(self.task, description=case.id)

    def finish(self, rec: CaseResult) -> None:
        self.done += 1
        self._number(rec.id)
        self.said.pop(rec.id, None)
        style = {"pass": "green", "unsupported": "yellow", "skipped": "yellow"}.get(rec.status, "red")
        style = "cyan" if shown(rec) != rec.status else style
        self.rp.console.print(f"[{style}]{shown(rec):>8}[/] {rec.id} ({rec.duration_s:.1f}s{rate(rec)})")
        self.rp.update(self.task, advance=1)

    def note(self, case_id: str, text: str) -> None:
        self.said[case_id] = time.monotonic()
        self.rp.update(self.task, description=f"{case_id}: {text}")

    def expect(self, total: int) -> None:
        super().expect(total)
        self.rp.update(self.task, total=total)

    def judged(self, rec: CaseResult) -> None:
        if rec.id not in self.number:
            return
        style = {"pass": "green", "unsupported": "yellow", "skipped": "yellow"}.get(rec.status, "red")
        self.rp.console.print(f"[{style}]{rec.status:>8}[/] {rec.id} (judged at the end)")

    def close(self) -> None:
        self.rp.stop()


def make_progress(total: int, quiet: bool = False) -> Progress:
    if not quiet and sys.stderr.isatty() and not os.environ.get("CI"):
        return RichProgress(total)
    return Progress(total, quiet)
