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
from kvdiag.tasks import DEFAULT_TASKS, TASKS_DIR, recall  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _docs(name):
    return [json.loads(line) for line in (TASKS_DIR / "data" / f"{name}.jsonl").read_text().splitlines()]


def test_task_data_is_what_make_tasks_generates(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_tasks.py"), "--out-dir", str(tmp_path)],
                   check=True, capture_output=True)
    for name in DEFAULT_TASKS:
        assert (tmp_path / f"{name}.jsonl").read_bytes() == (TASKS_DIR / "data" / f"{name}.jsonl").read_bytes()


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
