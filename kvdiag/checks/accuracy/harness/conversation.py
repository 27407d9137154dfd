"""Conversations through the engine: lm_eval's generate_until requests whose context holds turns
(``kvdiag/tasks/kv_turns.py``: the turns' texts separated by ``TURN``), run turn by turn.

lm_eval has no multi-turn generation: a request is one prompt and one answer. A conversation request is run as a
chat is served: turn k's prompt is turn k-1's prompt, the model's own answer to it and turn k's text, one
``generate`` call per turn for every conversation at that turn. An engine with a prefix cache (vLLM's default;
the builtin engine's when the case starts it so) serves each turn's earlier turns from the blocks the turn before
wrote, the blocks its decode filled included: later turns read earlier answers back from the KV cache, as a
multi-turn chat does. Conversations run in groups whose full lengths sum to at most ``GROUP_TOKENS``, so that a
group's earlier turns stay in the cache until their next turn. The answer lm_eval gets is the turns' answers
joined by ``TURN``.
"""

from __future__ import annotations

from kvdiag.tasks.kv_turns import TURN

# Tokens of the conversations one group holds: under the builtin engine's default KV cache (64 MiB) for the shipped
# and zoo models (2-4 KiB a token), so that no earlier turn is evicted before its next turn.
GROUP_TOKENS = 8192


def is_conversation(context: str) -> bool:
    return TURN in context


def run(lm, jobs: list[tuple[str, tuple[str, ...], int, bool]], progress=None) -> list[str]:
    """Each job (context with turns, stop strings, max tokens a turn, sampled) run turn by turn through ``lm``
    (an ``EngineLM``: its ``complete``); returns each conversation's answers joined by ``TURN``. ``progress``: called
    with the conversations done after each group."""
    turns = [context.split(TURN) for context, *_ in jobs]
    out: list = [None] * len(jobs)
    done = 0
    for group in _groups(lm, jobs, turns):
        text = {i: turns[i][0] for i in group}
        answers: dict = {i: [] for i in group}
        for k in range(max(len(turns[i]) for i in group)):
            live = [i for i in group if k < len(turns[i])]
            if k:
                for i in live:
                    text[i] += answers[i][-1] + turns[i][k]
            for kwargs, idx in _same_kwargs(jobs, live):
                for i, answer in zip(idx, lm.complete([text[i] for i in idx], *kwargs)):
                    answers[i].append(answer)
        for i in group:
            out[i] = TURN.join(answers[i])
        done += len(group)
        if progress is not None:
            progress(done)
    return out


def _same_kwargs(jobs, idx):
    """``idx`` by their generation arguments (stop strings, max tokens, sampled): one engine call each."""
    by: dict = {}
    for i in idx:
        by.setdefault(jobs[i][1:], []).append(i)
    return by.items()


def _groups(lm, jobs, turns) -> list[list[int]]:
    """Conversations by their number of turns (a group's engine calls are its longest's turns), in groups of at most
    ``GROUP_TOKENS`` tokens (their texts and every turn's answer at its longest; a longer conversation alone) and at
    most ``lm.batch_size`` conversations."""
    groups, size = [[]], 0
    for i in sorted(range(len(jobs)), key=lambda i: len(turns[i])):
        n = len(lm.tok_encode("".join(turns[i]))) + len(turns[i]) * jobs[i][2]
        if groups[-1] and (size + n > GROUP_TOKENS or len(groups[-1]) >= lm.batch_size):
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += n
    return [g for g in groups if g]
