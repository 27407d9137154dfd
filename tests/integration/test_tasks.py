"""The shipped lm_eval tasks (kvdiag/tasks) and the shipped tiny model (kvdiag/assets/tiny-llama)."""

import json
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from kvdiag.assets import TINY_MODEL  # noqa: E402
from kvdiag.tasks import DEFAULT_TASKS, SHIPPED_TASKS, TASKS_DIR, needle, recall  # noqa: E402
from kvdiag.tasks.kv_turns import TURN  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _docs(name):
    return [json.loads(line) for line in (TASKS_DIR / "data" / f"{name}.jsonl").read_text().splitlines()]


def test_task_data_is_what_make_tasks_generates(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_tasks.py"), "--out-dir", str(tmp_path)],
                   check=True, capture_output=True)
    shipped = sorted(p.name for p in (TASKS_DIR / "data").iterdir())
    made_at_load = {needle.TASK}  # its documents are made for the engine's window when it loads
    assert shipped == sorted(f"{name}.jsonl" for name in SHIPPED_TASKS if name not in made_at_load)  # and only those
    for name in shipped:
        assert (tmp_path / name).read_bytes() == (TASKS_DIR / "data" / name).read_bytes(), name


def _pairs(doc):
    """The context's pairs, read from its text (the first turn: the context and the first question)."""
    body = doc["context"].split(TURN)[0].partition(" ;")[0]
    return dict(p.split("=") for p in body.split(" "))


def test_decode_documents_are_chains_whose_every_pair_is_known_from_its_first_letter():
    docs = _docs("kv_decode")
    assert len(docs) == 100 and [len(d["answers"]) for d in docs[:5]] == [1, 2, 4, 8, 16]  # interleaved: --limit
    for doc in docs:
        pairs, turns = _pairs(doc), doc["context"].split(TURN)
        assert 48 <= len(pairs) == doc["n_pairs"] <= 64 and all(recall.is_heldout(_key_id(k)) for k in pairs)
        assert turns[0].endswith(" ; " + doc["keys"][0][0]) and all(t == " " + k[0] for t, k in
                                                                   zip(turns[1:], doc["keys"][1:]))
        assert len(turns) == len(doc["answers"]) == len(set(doc["keys"]))
        for key, answer in zip(doc["keys"], doc["answers"]):
            assert [k for k in pairs if k[0] == key[0]] == [key]  # no other key of the context starts so
            assert answer == key[1:] + "=" + pairs[key]
        assert doc["target"] == TURN.join(doc["answers"])


def test_multiturn_documents_ask_a_key_of_the_context_each_turn():
    docs = _docs("kv_multiturn")
    assert len(docs) == 100
    for doc in docs:
        pairs, turns = _pairs(doc), doc["context"].split(TURN)
        assert 32 <= len(pairs) == doc["n_pairs"] <= 48 and all(recall.is_heldout(_key_id(k)) for k in pairs)
        assert len(turns) == 12 and turns[0].endswith(f" ; {doc['keys'][0]}=")
        assert all(t == f" {k}=" for t, k in zip(turns[1:], doc["keys"][1:])) and len(set(doc["keys"])) == 12
        assert doc["answers"] == [pairs[k] for k in doc["keys"]]


@pytest.mark.parametrize("name, n_docs, pairs, first_frac", [("kv_recall", 200, (16, 16), 1.0),
                                                             ("kv_recall_long", 100, (64, 96), 0.1)])
def test_task_documents(name, n_docs, pairs, first_frac):
    docs = _docs(name)
    assert len(docs) == n_docs
    for doc in docs:
        ctx = doc["context"]
        assert ctx.isascii() and ctx.endswith(f" ; {doc['key']}=")
        body = dict(p.split("=") for p in ctx[: -len(f" ; {doc['key']}=")].split(" "))
        assert len(body) == doc["n_pairs"] and pairs[0] <= doc["n_pairs"] <= pairs[1]
        assert list(body).index(doc["key"]) == doc["position"] < max(1, -(-first_frac * doc["n_pairs"] // 1))
        assert len(set(doc["choices"])) == 4 and set(doc["choices"]) <= set(body.values())
        assert doc["choices"][doc["answer"]] == body[doc["key"]]
        # evaluation keys are disjoint from the keys training may use
        assert all(recall.is_heldout(_key_id(k)) for k in body)
    answers = [d["answer"] for d in docs]
    assert len(set(answers)) == 4  # the right choice is not always in one place


def _key_id(key):
    return sum((ord(c) - ord("a")) * 26**i for i, c in enumerate(key))


def test_task_manager_finds_the_tasks_from_any_directory(tmp_path, monkeypatch):
    from kvdiag.tasks import task_manager

    monkeypatch.chdir(tmp_path)  # data_files are relative to the YAML, not to the cwd
    tm = task_manager(include_defaults=False)
    assert {"kv_recall", "kv_recall_long", "kvdiag"} <= set(tm.all_tasks)
    if hasattr(tm, "load"):  # lm_eval >= 0.4.10
        tasks = tm.load(["kvdiag"])["tasks"]
    else:
        from lm_eval.tasks import get_task_dict

        tasks = get_task_dict(DEFAULT_TASKS, tm)
    assert set(tasks) == set(DEFAULT_TASKS)  # the "kvdiag" tag covers both
    docs = list(tasks["kv_recall"].test_docs())
    assert len(docs) == 200 and docs[0]["context"] == _docs("kv_recall")[0]["context"]


# ---------------------------------------------------------------- the shipped model
def test_shipped_model_is_small_bf16_and_loads_offline():
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    files = [p for p in TINY_MODEL.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) <= 5_000_000
    cfg = AutoConfig.from_pretrained(TINY_MODEL)
    assert cfg.architectures == ["LlamaForCausalLM"] and cfg.dtype == torch.bfloat16
    assert cfg.num_key_value_heads < cfg.num_attention_heads  # GQA
    assert cfg.hidden_size // cfg.num_attention_heads == 64
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL)
    assert model.dtype == torch.bfloat16
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    tok = AutoTokenizer.from_pretrained(TINY_MODEL)
    doc = _docs("kv_recall")[0]
    ids = tok(doc["context"], return_tensors="pt").input_ids
    assert ids[0, 0].item() == tok.bos_token_id
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
    assert tok.decode(out[0, ids.shape[1]:]) == doc["choices"][doc["answer"]]


class _TransformersLM:
    """A minimal lm_eval LM (loglikelihood only) over a transformers model, no accelerate needed."""

    def __new__(cls, path):
        from lm_eval.api.model import LM
        from transformers import AutoModelForCausalLM, AutoTokenizer

        class TransformersLM(LM):
            def __init__(self):
                super().__init__()
                self.tok = AutoTokenizer.from_pretrained(path)
                self.model = AutoModelForCausalLM.from_pretrained(path).eval()

            @torch.no_grad()
            def loglikelihood(self, requests, disable_tqdm=False):
                pairs = [r.args for r in requests]
                enc = [(self.tok(c).input_ids, self.tok(x, add_special_tokens=False).input_ids) for c, x in pairs]
                out = [None] * len(enc)
                by_len = {}
                for i, (c, x) in enumerate(enc):
                    by_len.setdefault((len(c), len(x)), []).append(i)
                for (lc, lx), idx in by_len.items():
                    for s in range(0, len(idx), 64):
                        chunk = idx[s : s + 64]
                        ids = torch.tensor([enc[i][0] + enc[i][1] for i in chunk])
                        logp = self.model(ids[:, :-1]).logits.float().log_softmax(-1)[:, lc - 1 :]
                        tgt = ids[:, lc:]
                        ll = logp.gather(-1, tgt[..., None])[..., 0].sum(-1)
                        greedy = (logp.argmax(-1) == tgt).all(-1)
                        for j, i in enumerate(chunk):
                            out[i] = (ll[j].item(), bool(greedy[j]))
                return out

            def loglikelihood_rolling(self, requests, disable_tqdm=False):
                raise NotImplementedError

            def generate_until(self, requests, disable_tqdm=False):
                raise NotImplementedError

        return TransformersLM()


@pytest.mark.slow
@pytest.mark.parametrize("task, limit, floor", [("kv_recall", None, 0.95), ("kv_recall_long", 40, 0.90)])
def test_shipped_model_recalls_through_lm_eval(task, limit, floor):
    import lm_eval

    from kvdiag.tasks import task_manager

    res = lm_eval.simple_evaluate(model=_TransformersLM(TINY_MODEL), tasks=[task], limit=limit, bootstrap_iters=0,
                                  task_manager=task_manager(include_defaults=False))
    assert res["results"][task]["acc,none"] >= floor


# ---------------------------------------------------------------- tasks of your own difficulty
def _make_task(tmp_path, *args):
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "make_tasks.py"), "--out-dir", str(tmp_path), *args],
                          capture_output=True, text=True, timeout=120)


def _load_tasks(folder, names):
    from kvdiag.tasks import task_manager

    tm = task_manager(include_paths=[folder], include_defaults=False)
    if hasattr(tm, "load"):
        return tm.load(names)["tasks"]
    from lm_eval.tasks import get_task_dict

    return get_task_dict(names, tm)


def test_make_tasks_writes_a_task_of_the_asked_pairs_position_and_queries(tmp_path, monkeypatch):
    r = _make_task(tmp_path, "--name", "kv_x", "--pairs", "20-24", "--first-frac", "0.25", "--queries", "3",
                   "--docs", "30", "--seed", "5")
    assert r.returncode == 0, r.stderr
    docs = [json.loads(line) for line in (tmp_path / "kv_x.jsonl").read_text().splitlines()]
    assert len(docs) == 30 and len({d["n_pairs"] for d in docs}) > 1
    for doc in docs:
        body, _, asked = doc["context"].partition(" ;")
        pairs = dict(p.split("=") for p in body.split(" "))
        assert len(pairs) == doc["n_pairs"] and 20 <= doc["n_pairs"] <= 24
        assert list(pairs).index(doc["key"]) == doc["position"] < -(-0.25 * doc["n_pairs"] // 1)
        queries = asked.split(" ")[1:]  # " k1=v1 k2=v2 k3=v3 key="
        assert len(queries) == 4 and queries[-1] == f"{doc['key']}="
        answered = dict(q.split("=") for q in queries[:-1])
        assert doc["key"] not in answered and all(pairs[k] == v for k, v in answered.items())  # the right values
        assert doc["choices"][doc["answer"]] == pairs[doc["key"]]
    again = tmp_path / "again"
    assert _make_task(again, "--name", "kv_x", "--pairs", "20-24", "--first-frac", "0.25", "--queries", "3",
                      "--docs", "30", "--seed", "5").returncode == 0
    assert (again / "kv_x.jsonl").read_bytes() == (tmp_path / "kv_x.jsonl").read_bytes()  # deterministic
    monkeypatch.chdir(ROOT)  # the YAML's data and loader are found beside it, from any directory
    tasks = _load_tasks(str(tmp_path), ["kv_x"])
    assert [d["context"] for d in tasks["kv_x"].test_docs()] == [d["context"] for d in docs]


def test_make_tasks_generate_variant_is_a_generation_task_scored_by_exact_match(tmp_path):
    assert _make_task(tmp_path, "--name", "kv_g", "--generate", "--gen-toks", "6", "--docs", "5").returncode == 0
    task = _load_tasks(str(tmp_path), ["kv_g"])["kv_g"]
    assert task.OUTPUT_TYPE == "generate_until"
    doc = next(iter(task.test_docs()))
    assert task.doc_to_target(doc) == doc["choices"][doc["answer"]]
    assert task.config.generation_kwargs["max_gen_toks"] == 6
    from lm_eval.filters.extraction import RegexFilter

    [flt] = task.config.filter_list  # the value: the first 4 digits the model writes
    regex = RegexFilter(regex_pattern=flt["filter"][0]["regex_pattern"])
    assert list(regex.apply([["0932"], [" 0932 ; ab"], ["93"]], [doc] * 3)) == [["0932"], ["0932"], ["[invalid]"]]


@pytest.mark.parametrize("args", [["--name", "kv_recall"], ["--name", "kv_decode"], ["--name", "kv_y", "--pairs", "2"],
                                  ["--name", "kv_y", "--pairs", "8", "--queries", "8"], ["--name", "kv y"]])
def test_make_tasks_bad_knobs_exit_2_without_writing(tmp_path, args):
    r = _make_task(tmp_path / "out", *args)
    assert r.returncode == 2 and "error:" in r.stderr and not (tmp_path / "out").exists()


def test_a_harder_task_shows_a_loss_on_the_shipped_model(tmp_path):
    """The shipped model scores 1.0 on the shipped tasks; past the 100 pairs it was trained on it does not."""
    assert _make_task(tmp_path / "t", "--name", "kv_hard", "--pairs", "150-190", "--first-frac", "0.1",
                      "--docs", "40").returncode == 0
    r = subprocess.run([sys.executable, "-m", "kvdiag", "accuracy", "--include-path", str(tmp_path / "t"), "-t",
                        "kv_hard", "-d", "auto", "-o", str(tmp_path / "r")], capture_output=True, text=True,
                       cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    rec = json.loads((tmp_path / "r" / "results.jsonl").read_text().splitlines()[-1])
    score = rec["metrics"]["scores"]["kv_hard"]["acc"]
    assert score["n"] == 40 and 0.5 <= score["score"] <= 0.95
