"""kv_needle's documents (kvdiag/tasks/needle.py) sit where their tags say: measured with the shipped model's own
tokenizer (the ``tokenizers`` library on its tokenizer.json, not kvdiag's arithmetic), each document's request fits
its cell's length and fills it to within a pair, and the asked pair starts at the token its depth names."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvdiag.assets import TINY_MODEL
from kvdiag.tasks import needle, recall

ROOT = Path(__file__).resolve().parents[2]
LENGTHS = [63, 100, 128, 777, 2048]


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(TINY_MODEL / "tokenizer.json"))


def _pairs(doc) -> list[tuple[str, str]]:
    body = doc["context"][: -len(f" ; {doc['key']}=")]
    return [tuple(p.split("=")) for p in body.split(" ")]


def test_each_document_fits_its_length_and_asks_the_pair_at_its_depth(tokenizer):
    docs = needle.documents(LENGTHS, per_cell=2)
    assert len(docs) == len(LENGTHS) * len(needle.DEPTHS) * 2
    for doc in docs:
        length, depth = doc["needle_length"], doc["needle_depth"]
        pairs = _pairs(doc)
        assert doc["context"].endswith(f" ; {doc['key']}=") and len(pairs) == doc["n_pairs"]
        answer = doc["choices"][doc["answer"]]
        # the whole request as the engine gets it: BOS (the tokenizer's post-processor), context, the answer
        request = tokenizer.encode(doc["context"] + answer).ids
        assert request[0] == tokenizer.token_to_id("<s>")
        assert length - 1 - recall.PAIR_TOKENS < len(request) <= length - 1, (length, len(request))
        assert len(request) == doc["tokens"]
        # the needle: the asked key's pair, its token position measured by encoding the text before it
        at = [k for k, _ in pairs].index(doc["key"])
        assert at == doc["position"] and pairs[at][1] == answer
        before = " ".join(f"{k}={v}" for k, v in pairs[:at]) + (" " if at else "")
        start = len(tokenizer.encode(before).ids)  # BOS included: the pair's first token's index
        assert start == 1 + recall.PAIR_TOKENS * at
        assert tokenizer.encode(doc["context"]).tokens[start:start + recall.KEY_LEN] == list(doc["key"])
        # the relative position is the depth, to the nearest pair
        assert abs(at / (len(pairs) - 1) - depth) <= 0.5 / (len(pairs) - 1) + 1e-12
        if depth in (0.0, 1.0):
            assert at == (0 if depth == 0.0 else len(pairs) - 1)
        keys = [k for k, _ in pairs]
        assert len(set(keys)) == len(keys) and all(recall.is_heldout(_key_id(k)) for k in keys)
        assert len(set(doc["choices"])) == 4 and set(doc["choices"]) <= {v for _, v in pairs}


def _key_id(key):
    return sum((ord(c) - ord("a")) * 26**i for i, c in enumerate(key))


def test_documents_go_round_the_cells_so_a_limit_keeps_the_grid_whole():
    docs = needle.documents([128, 256, 512], per_cell=3)
    cells = [(d["needle_length"], d["needle_depth"]) for d in docs]
    n = 3 * len(needle.DEPTHS)
    for k in range(3):
        assert sorted(cells[k * n:(k + 1) * n]) == sorted({(x, d) for x in (128, 256, 512) for d in needle.DEPTHS})
    assert [d["id"] for d in docs] == list(range(len(docs)))


def test_a_cell_gets_the_same_documents_in_any_grid():
    alone = [d for d in needle.documents([1024], per_cell=2)]
    among = [d for d in needle.documents([256, 1024, 2048], per_cell=2) if d["needle_length"] == 1024]
    strip = lambda ds: [{k: v for k, v in d.items() if k != "id"} for d in ds]  # noqa: E731
    assert strip(alone) == strip(among)
    assert needle.documents([1024], per_cell=2) == alone  # deterministic
    assert needle.documents([1024], per_cell=2, seed=needle.SEED + 1) != alone


def test_default_lengths_are_the_window_and_its_halves():
    assert needle.default_lengths(2048) == [128, 256, 512, 1024, 2048]
    assert needle.default_lengths(8192) == [512, 1024, 2048, 4096, 8192]
    assert needle.default_lengths(200) == [100, 200]  # none shorter than a pair a depth
    assert needle.default_lengths(needle.MIN_LENGTH - 1) == []
    assert needle.length_problem([128, 4096], 2048, "the window") == \
        "needle length 4096: longer than the window (2048 tokens)"
    assert needle.length_problem([needle.MIN_LENGTH], needle.MIN_LENGTH, "w") is None
    assert "at least" in needle.length_problem([needle.MIN_LENGTH - 1], 2048, "w")


def test_make_tasks_writes_the_same_documents_as_the_task(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_tasks.py"), "--name", "my_needle", "--needle",
                    "128,64", "--per-cell", "2", "--out-dir", str(tmp_path)], check=True, capture_output=True)
    written = [json.loads(line) for line in (tmp_path / "my_needle.jsonl").read_text().splitlines()]
    assert written == needle.documents([64, 128], per_cell=2)
    assert "!function kv_utils.load_json" in (tmp_path / "my_needle.yaml").read_text()


def test_the_task_loads_the_grid_its_metadata_names():
    from kvdiag.tasks import task_manager

    tm = task_manager(include_defaults=False, metadata={"needle_lengths": [64, 256], "pretrained": "m"})
    task = tm.load(["kv_needle"])["tasks"]["kv_needle"]
    docs = list(task.test_docs())
    assert docs == needle.documents([64, 256])
    tm = task_manager(include_defaults=False, metadata={"max_model_len": 1024, "needle_per_cell": 1})
    docs = list(tm.load(["kv_needle"])["tasks"]["kv_needle"].test_docs())
    assert sorted({d["needle_length"] for d in docs}) == needle.default_lengths(1024)
    assert len(docs) == len(needle.default_lengths(1024)) * len(needle.DEPTHS)
