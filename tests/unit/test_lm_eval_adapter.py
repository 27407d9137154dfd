"""EngineLM against lm_eval's own HFLM on the same weights, and run_tasks on the shipped tasks."""

import json
import math
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import torch  # noqa: E402
from hf_engine import HFEngine  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402

from kvdiag.checks.accuracy.harness.lm_eval_adapter import EngineLM, resolve_tasks, run_tasks  # noqa: E402
from kvdiag.errors import UserError  # noqa: E402
from kvdiag.tasks import SHIPPED_TASKS  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def two_threads():
    """Two torch threads for this module's tests only: set at import, every xdist worker kept them for every test it
    ran after collecting this module (an in-process torch test took many times longer on two loaded cores)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    from kvdiag.models.gen import make_random_model

    return make_random_model(tmp_path_factory.mktemp("m") / "llama", "llama", hidden_size=64, num_layers=2,
                             init_std=0.2, seed=3)


@pytest.fixture(scope="module")
def engine(model_path):
    return HFEngine(model_path)


def hflm(path, **kw):
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=str(path), batch_size=1, device="cpu", dtype="float32", **kw)


def reqs(kind, args):
    return [Instance(kind, {}, a, i) for i, a in enumerate(args)]


LL_ARGS = [("abc=12 xyz=34 ; abc=", "12"), ("abc=12 xyz=34 ; abc=", "34"), ("abc=12 xyz=34 ; abc=", "99"),
           ("The cat sat on the ", "mat"),  # trailing space moves to the continuation
           ("", "hello"),  # empty context: conditioned on the prefix (BOS) token
           ("x" * 40, "yz")]


def test_loglikelihood_matches_hflm_in_one_batched_engine_call(model_path, engine):
    engine.calls.clear()
    ours = EngineLM(engine, max_length=2048).loglikelihood(reqs("loglikelihood", LL_ARGS))
    theirs = hflm(model_path).loglikelihood(reqs("loglikelihood", LL_ARGS))
    assert engine.calls == [("score", len(LL_ARGS))]
    for (a, ga), (b, gb) in zip(ours, theirs):
        assert a == pytest.approx(b, abs=1e-4) and ga == gb
    assert ours[0][0] != pytest.approx(ours[1][0])  # the continuations really are scored


def test_long_contexts_are_left_truncated_like_hflm(model_path, engine):
    # HFLM(max_length=L) feeds L tokens and scores the L+1st; an engine scores all it is fed: L+1.
    ours = EngineLM(engine, max_length=17).loglikelihood(reqs("loglikelihood", LL_ARGS))
    theirs = hflm(model_path, max_length=16).loglikelihood(reqs("loglikelihood", LL_ARGS))
    for (a, _), (b, _) in zip(ours, theirs):
        assert a == pytest.approx(b, abs=1e-4)


def test_requests_cut_to_the_max_length_are_counted_for_the_cases_warning(model_path, engine):
    """The accuracy case's `truncated` warning: how many requests lost the start of their context, counted against
    the model's own tokenizer (BOS + context + continuation), for loglikelihood and generate_until alike."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    sizes = [len(tok(ctx + cont)["input_ids"]) for ctx, cont in LL_ARGS]
    lm = EngineLM(engine, max_length=17)
    lm.loglikelihood(reqs("loglikelihood", LL_ARGS))
    assert lm.truncation() == {"truncated": sum(n > 17 for n in sizes), "requests": len(LL_ARGS),
                               "longest": max(sizes), "max_length": 17}
    assert 0 < lm.truncated < len(LL_ARGS)
    whole = EngineLM(engine, max_length=2048)
    whole.loglikelihood(reqs("loglikelihood", LL_ARGS))
    assert whole.truncated == 0
    gen = EngineLM(engine, max_length=20)  # room for the prompt: 20 - 6 generated tokens
    gen.generate_until(reqs("generate_until", [("x" * 30, {"until": ["\n"], "max_gen_toks": 6}),
                                               ("abc", {"until": ["\n"], "max_gen_toks": 6})]))
    assert (gen.truncated, gen.requests, gen.longest) == (1, 2, len(tok("x" * 30)["input_ids"]))


def test_batches_never_split_a_shared_context(engine):
    engine.calls.clear()
    lm = EngineLM(engine, batch_size=4)
    args = [(f"ctx{i % 3} ", f"c{j}") for i in range(3) for j in range(3)]
    lm.loglikelihood(reqs("loglikelihood", args))
    assert [n for _, n in engine.calls] == [3, 3, 3]


def test_loglikelihood_rolling_matches_hflm_and_a_plain_forward(model_path, engine):
    text = "the quick brown fox jumps over the lazy dog, again and again"
    ours_full = EngineLM(engine, max_length=2048).loglikelihood_rolling(reqs("loglikelihood_rolling", [(text,)]))
    ids = engine.encode(text)  # BOS + bytes
    lp = engine._logprobs(ids)
    direct = float(lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].sum())
    assert ours_full[0] == pytest.approx(direct, abs=1e-3)
    # several windows: the same windows as HFLM without its own BOS in the text
    ours = EngineLM(engine, max_length=17).loglikelihood_rolling(reqs("loglikelihood_rolling", [(text,)]))
    theirs = hflm(model_path, max_length=16, add_bos_token=False).loglikelihood_rolling(
        reqs("loglikelihood_rolling", [(text,)]))
    assert ours[0] == pytest.approx(theirs[0], abs=1e-3) and ours[0] != pytest.approx(direct, abs=1e-3)


def test_generate_until_matches_hflm_and_stops_at_until(model_path, engine):
    args = [("abc=12 ; abc=", {"until": ["\n"], "max_gen_toks": 6, "do_sample": False}),
            ("hello", {"until": ["\n"], "max_gen_toks": 6, "do_sample": False})]
    ours = EngineLM(engine).generate_until(reqs("generate_until", args))
    theirs = hflm(model_path).generate_until(reqs("generate_until", args))
    assert ours == theirs
    first = ours[0][:2]
    cut = EngineLM(engine).generate_until(reqs("generate_until", [(args[0][0], {"until": [first[1:]],
                                                                               "max_gen_toks": 6})]))
    assert cut == [first[:1]]


@pytest.mark.slow
def test_unknown_task_is_a_user_error():
    with pytest.raises(UserError, match="unknown task 'no_such_task_xyz'.*kv_recall"):
        resolve_tasks(["no_such_task_xyz"])
    recall = [t for t in SHIPPED_TASKS if t.startswith("kv_recall")]
    assert resolve_tasks(["kv_recall*"]) == (recall, False)  # every shipped recall task, from kvdiag's folder alone
    assert resolve_tasks(["kv_*"]) == (sorted(SHIPPED_TASKS), False)  # the conversations too


def test_run_tasks_on_a_shipped_task_gives_per_document_values(engine):
    out = run_tasks(EngineLM(engine), ["kv_recall"], limit=12, seed=0)
    samples = out["samples"]["kv_recall"]
    assert set(samples) == {"acc", "acc_norm"}
    assert sorted(samples["acc"], key=int) == [str(i) for i in range(12)]
    assert set(samples["acc"].values()) <= {0.0, 1.0}
    score = out["scores"]["kv_recall"]["acc"]
    assert score["n"] == 12 and score["higher_is_better"] is True
    assert score["score"] == pytest.approx(sum(samples["acc"].values()) / 12)
    p = score["score"]
    assert score["stderr"] == pytest.approx(math.sqrt(p * (1 - p) / 11), abs=1e-9)


def test_each_tasks_hash_is_lm_evals_own_task_hash(engine, monkeypatch, tmp_path):
    """lm_eval's EvaluationTracker computes the task hashes of its results file from the same samples: the oracle."""
    import lm_eval
    from lm_eval.loggers import EvaluationTracker

    got = []
    real = lm_eval.simple_evaluate
    monkeypatch.setattr(lm_eval, "simple_evaluate", lambda **kw: got.append(real(**kw)) or got[-1])
    out = run_tasks(EngineLM(engine), ["kv_recall", "kv_recall_long"], limit=4, seed=0)
    res = dict(got[0])
    samples = res.pop("samples")
    res.pop("config", None)
    EvaluationTracker(output_path=str(tmp_path)).save_results_aggregated(results=res, samples=samples)
    (written,) = tmp_path.rglob("results_*.json")
    want = json.loads(written.read_text())["task_hashes"]
    tasks = out["settings"]["tasks"]
    assert {t: v["hash"] for t, v in tasks.items()} == want and len(set(want.values())) == 2
    assert tasks["kv_recall"]["documents"] == 4 and tasks["kv_recall"]["version"] == 1.0


def test_run_tasks_skips_lm_evals_environment_probe_and_restores_it(engine, monkeypatch):
    # collect_env runs `pip list` & co. (~0.8 s a dtype); kvdiag records its own environment
    import lm_eval.evaluator as ev
    import torch.utils.collect_env as ce

    calls = []
    monkeypatch.setattr(ce, "get_pretty_env_info", lambda: calls.append("collect_env") or "")
    before = (ev.add_env_info, ev.get_git_commit_hash)
    run_tasks(EngineLM(engine), ["kv_recall"], limit=2, seed=0)
    assert calls == [] and (ev.add_env_info, ev.get_git_commit_hash) == before
    ev.add_env_info({})  # still lm_eval's own function outside run_tasks
    assert calls == ["collect_env"]


def test_the_probe_stays_off_while_any_thread_evaluates_and_comes_back_after_the_last():
    # cases on threads (--isolate run on the CPU) overlap: A in, B in, A out, B out
    import lm_eval.evaluator as ev

    from kvdiag.checks.accuracy.harness.lm_eval_adapter import _without_env_probe

    own = ev.add_env_info
    a, b = _without_env_probe(), _without_env_probe()
    a.__enter__()
    b.__enter__()
    a.__exit__(None, None, None)
    assert ev.add_env_info is not own  # B still evaluates
    b.__exit__(None, None, None)
    assert ev.add_env_info is own


def test_kvdiags_own_tasks_resolve_without_importing_lm_eval():
    import subprocess
    import sys

    script = ("import sys; from kvdiag.checks.accuracy.cases import _tasks; "
              "print(_tasks(None, None), _tasks(['kv_recall,kv_recall'], None), 'lm_eval' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "(['kv_recall', 'kv_recall_long'], False) (['kv_recall'], False) False", out.stderr


class Reporting(HFEngine):
    """The HF engine as an engine that says its finished requests while a call runs (protocol.ReportsFinished),
    one by one."""

    on_finished = None

    def score(self, contexts, continuations, **kw):
        out = super().score(contexts, continuations, **kw)
        for n in range(1, len(out) + 1):
            if self.on_finished is not None:
                self.on_finished(n)
        return out


def test_progress_moves_inside_one_engine_call_with_rate_and_time_left(model_path, monkeypatch):
    """One call of 12 requests (the whole task, as vLLM gets it): the lines come while it runs, from the engine's
    own count, not once at its end; the count never steps back; the engine's hook is cleared after the call."""
    from kvdiag.checks.accuracy.harness import lm_eval_adapter
    from kvdiag.engines.protocol import ReportsFinished

    monkeypatch.setattr(lm_eval_adapter, "PROGRESS_S", 0.0)
    engine = Reporting(model_path)
    assert isinstance(engine, ReportsFinished) and not isinstance(HFEngine(model_path), ReportsFinished)
    lines = []
    lm = EngineLM(engine, on_progress=lines.append)
    lm.loglikelihood([Instance("loglikelihood", {}, (f"ctx{i} ", "c"), i, metadata=("t", i, 1)) for i in range(12)])
    docs = [int(x.split("/")[0]) for x in lines]
    assert len(engine.calls) == 1 and docs == sorted(docs) and docs[-1] == 12 and len(docs) >= 10, lines
    assert all(x.endswith(" s left") for x in lines[:-1]) and "doc/s" in lines[-1], lines
    assert engine.on_finished is None
