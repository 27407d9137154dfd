"""kv_needle's grid, resolved before any worker starts: its lengths (``--needle-length``, else ``needle_lengths`` of
``--metadata``, else the engine's window and its halves), checked against the window the engine will run the model
at (its traits' ``max_model_len``: ``-a max_model_len`` or kvdiag's default, capped by the model's config); a length
past it is bad input. The lengths reach the task through its metadata (``kv_utils.load_needle`` makes the
documents in the worker)."""

from __future__ import annotations


def needle_params(p, sweep, task_names: list[str], metadata: dict) -> dict:
    """The case params kv_needle adds for AccuracyParams ``p`` and the sweep's engine and model: ``metadata`` with
    the grid's lengths, and ``needle`` (lengths, depths, the engine's window, the model's
    ``max_position_embeddings``); {} without kv_needle. UserError on a bad length."""
    from kvdiag.engines.base import engine_traits
    from kvdiag.errors import UserError
    from kvdiag.models import config, label
    from kvdiag.tasks import needle

    if needle.TASK not in task_names:
        if p.needle_lengths:
            raise UserError(f"--needle-length: the lengths of {needle.TASK}'s grid; add -t {needle.TASK}")
        return {}
    model = sweep.model
    window = engine_traits(sweep.engine).max_model_len(model, sweep.spec["engine_args"])
    top = config(model, text=True).get("max_position_embeddings")
    top = top if isinstance(top, int) else None
    lengths = _asked(p.needle_lengths or metadata.get("needle_lengths")) or needle.default_lengths(window)
    where = f"the engine's max_model_len for {label(model)}"
    problem = needle.length_problem(lengths, window, where) if lengths else \
        f"{needle.TASK}: the engine's max_model_len for {label(model)} ({window}) holds no grid (at least " \
        f"{needle.MIN_LENGTH} tokens)"
    if problem:
        raise UserError(problem + (f"; the model takes {top}: -a max_model_len={top}" if top and top > window else ""))
    return {"metadata": {**metadata, "needle_lengths": lengths},
            "needle": {"lengths": lengths, "depths": list(needle.DEPTHS), "window": window, "model_positions": top}}


def _asked(lengths) -> list[int]:
    from kvdiag.errors import UserError

    try:
        return sorted({int(n) for n in ([lengths] if isinstance(lengths, (int, str)) else lengths or ())})
    except (TypeError, ValueError):
        raise UserError(f"needle_lengths {lengths!r}: give token counts (--needle-length N, repeatable)") from None
