"""The conversation tasks (kv_decode, kv_multiturn) through kvdiag's lm_eval model: their turns run in sequence on
the model's own answers (kvdiag/checks/accuracy/harness/conversation.py), the engine's prefix cache serves the earlier
turns, and
their scores are exact match of what the model wrote (kvdiag/tasks/kv_turns.py), each against a by-hand oracle."""

import json

import pytest
from lm_eval.api.instance import Instance

from kvdiag.assets import TINY_MODEL
from kvdiag.checks.accuracy.harness.lm_eval_adapter import EngineLM, cut_at_stop
from kvdiag.tasks import TASKS_DIR
from kvdiag.tasks.kv_turns import TURN, process_decode, process_turns

# the tasks' own generation arguments (kv_decode.yaml, kv_multiturn.yaml)
UNTIL = [" ", ";"]
GEN = {"kv_decode": {"until": UNTIL, "max_gen_toks": 8, "do_sample": False},
       "kv_multiturn": {"until": UNTIL, "max_gen_toks": 4, "do_sample": False}}


@pytest.fixture(scope="module")
def engine():
    from kvdiag.engines.builtin.engine import BuiltinEngine
    from kvdiag.engines.protocol import EngineSpec

    e = BuiltinEngine()
    e.start(EngineSpec(model=str(TINY_MODEL), device="cpu", prefix_caching=True))
    yield e
    e.shutdown()


def _docs(name, n):
    lines = (TASKS_DIR / "data" / f"{name}.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines[:n]]


def _by_hand(engine, doc, gen):
    """The conversation one turn at a time, one request each: every prompt the one before, the answer and the next
    turn's text."""
    turns, answers = doc["context"].split(TURN), []
    text = turns[0]
    for k in range(len(turns)):
        if k:
            text += answers[-1] + turns[k]
        done = engine.generate([text], gen["max_gen_toks"], greedy=True, stop=gen["until"])[0]
        answers.append(cut_at_stop(done.text, gen["until"]))
    return answers


def test_each_turn_is_generated_on_the_models_own_earlier_answers(engine):
    docs = [("kv_multiturn", d) for d in _docs("kv_multiturn", 4)] + [("kv_decode", d) for d in _docs("kv_decode", 5)]
    plain = ("abcd=1234 efgh=5678 ; efgh=", GEN["kv_multiturn"])  # not a conversation: answered as before
    reqs = [Instance("generate_until", {}, (d["context"], GEN[name]), i) for i, (name, d) in enumerate(docs)]
    reqs.append(Instance("generate_until", {}, plain, len(reqs)))
    out = EngineLM(engine).generate_until(reqs)
    for (name, doc), got in zip(docs, out):
        assert got.split(TURN) == _by_hand(engine, doc, GEN[name])
        assert len(got.split(TURN)) == len(doc["answers"])
    assert out[-1] == cut_at_stop(engine.generate([plain[0]], 4, greedy=True, stop=UNTIL)[0].text, UNTIL)
    assert TURN not in out[-1]


def test_the_prefix_cache_serves_every_turn_the_turns_before(engine):
    doc = _docs("kv_multiturn", 1)[0]
    turns = doc["context"].split(TURN)
    first_blocks = len(engine.encode(turns[0])) // engine.kv.block_size  # full blocks of turn 1's prompt
    engine.reset_prefix_cache()
    before = engine.path_counters()["prefix_hit_tokens"]
    EngineLM(engine).generate_until([Instance("generate_until", {}, (doc["context"], GEN["kv_multiturn"]), 0)])
    hits = engine.path_counters()["prefix_hit_tokens"] - before
    # each later turn starts with turn 1's prompt: its full blocks at least come from the cache every time
    assert hits >= (len(turns) - 1) * first_blocks * engine.kv.block_size > 0


def test_exact_match_is_every_turn_right_by_hand(engine):
    docs = _docs("kv_decode", 10)
    reqs = [Instance("generate_until", {}, (d["context"], GEN["kv_decode"]), i) for i, d in enumerate(docs)]
    out = EngineLM(engine).generate_until(reqs)
    right = 0
    for doc, got in zip(docs, out):
        # the oracle: the context's own pairs, read from its text, against what the model wrote after each letter
        context = doc["context"].split(TURN)[0]
        pairs = dict(p.split("=") for p in context.split(" ;")[0].split(" "))
        letters = [t.strip()[-1] for t in doc["context"].split(TURN)]
        want = [k[1:] + "=" + pairs[k] for k in (next(k for k in pairs if k[0] == c) for c in letters)]
        every = got.split(TURN) == want
        right += every
        n = len(doc["answers"])
        assert process_decode(doc, [got]) == {"exact_match": float(every), f"exact_match_len{n}": float(every)}
    assert right > 0  # the model writes the chains: not a score of nothing
    doc = _docs("kv_multiturn", 1)[0]
    answers = list(doc["answers"])
    assert process_turns(doc, [TURN.join(answers)]) == {"exact_match": 1.0, "turns_right": 1.0}
    answers[3] = "0000" if answers[3] != "0000" else "1111"
    assert process_turns(doc, [TURN.join(answers)]) == {"exact_match": 0.0,
                                                        "turns_right": (len(answers) - 1) / len(answers)}
    assert process_turns(doc, [TURN.join(answers[:5])])["turns_right"] == 4 / len(answers)  # missing turns: wrong


def test_conversation_tasks_start_their_engines_with_a_prefix_cache():
    from kvdiag.checks.accuracy import Accuracy
    from kvdiag.checks.cases import Target
    from kvdiag.checks.registry import check_cases

    cases, _ = check_cases("accuracy", Target(kv_dtypes=["auto", "fp8"], device="cpu"),
                           Accuracy().make({"tasks": ["kv_recall,kv_multiturn"]}))
    assert [c.params.get("prefix_caching") for c in cases] == [True, True]
