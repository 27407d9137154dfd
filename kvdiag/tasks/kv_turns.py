"""Conversation tasks' format and scoring (kv_decode, kv_multiturn; referenced by their YAML as
``!function kv_turns.process_...``).

A document's ``context`` holds its turns separated by ``TURN``: kvdiag's lm_eval model
(``kvdiag/checks/accuracy/harness/conversation.py``) runs them in sequence, each turn's prompt the one before, the
model's answer
and the next turn's text, and answers with the turns' answers joined by ``TURN``. A document's ``answers`` are the
gold answer of each turn. Self-contained on purpose, as ``kv_utils.py``: lm_eval imports it by file path.
"""

TURN = "\x1e"  # ASCII record separator: in no task text, one byte either way


def turn_answers(response: str) -> list[str]:
    """The answer of each turn from what the model gave (``TURN``-joined)."""
    return response.split(TURN)


def _right(doc, results) -> list[bool]:
    got = turn_answers(results[0] if results else "")
    return [i < len(got) and got[i] == gold for i, gold in enumerate(doc["answers"])]


def process_decode(doc, results) -> dict:
    """kv_decode: ``exact_match`` (every pair of the chain written right) and the same under
    ``exact_match_len{N}``, N the chain's length, for the per-length breakdown (each length's documents only)."""
    right = float(all(_right(doc, results)))
    return {"exact_match": right, f"exact_match_len{len(doc['answers'])}": right}


def process_turns(doc, results) -> dict:
    """kv_multiturn: ``exact_match`` (every turn answered right) and ``turns_right`` (the share of turns right)."""
    right = _right(doc, results)
    return {"exact_match": float(all(right)), "turns_right": sum(right) / len(right)}
