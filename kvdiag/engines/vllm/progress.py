"""Requests finished inside one call of kvdiag's vLLM engine, as they finish: vLLM's ``LLM.generate`` takes a
progress bar factory (``use_tqdm=callable``) and updates the bar once per finished request; this bar reports the
running count to the engine's ``on_finished`` (``kvdiag.engines.protocol.ReportsFinished``), so that a long lm_eval
task says its rate and time left every few seconds instead of once at its end."""

from __future__ import annotations

import time
from typing import Callable


class Finished:
    """The count of one kvdiag call (it may make several ``LLM.generate`` calls), reported to ``report``."""

    def __init__(self, report: Callable[[int], None]):
        self.report, self.done = report, 0

    def bar(self, iterable=None, total: int | None = None, **_):
        """What vLLM calls with ``use_tqdm``: a bar for one ``LLM.generate`` call's finished requests; given an
        iterable (its prompts, as it renders them), that iterable as it is: rendering is not a request finished."""
        return iterable if iterable is not None else _Bar(self)

    def set(self, done: int) -> None:
        """The count after a pass whose requests are not all done (scored again in another pass)."""
        self.done = done
        self.report(done)


def bar_for(report: Callable[[int], None] | None):
    """``use_tqdm`` for a call: False (no bar) where nothing listens, else a new count's bar factory."""
    return Finished(report).bar if report is not None else False


class _Bar:
    """The part of tqdm that vLLM's ``_run_engine`` uses: ``update``, ``n``, ``postfix``, ``format_dict['elapsed']``,
    ``refresh``, ``close``."""

    def __init__(self, count: Finished):
        self.count, self.n, self.postfix, self._t0 = count, 0, "", time.perf_counter()

    @property
    def format_dict(self) -> dict:
        return {"elapsed": max(time.perf_counter() - self._t0, 1e-9)}

    def update(self, n: int = 1) -> None:
        self.n += n
        self.count.done += n
        self.count.report(self.count.done)

    def refresh(self) -> None:
        pass

    def close(self) -> None:
        pass
