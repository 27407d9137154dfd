"""kv_needle's grid in the parent (kvdiag/checks/accuracy/needle.py): each cell's score is the mean of its documents'
per-document results, recounted here by hand and by pandas; the worst cell is the largest drop from the baseline's
same cell; and the grid's lengths are resolved and refused before any worker starts (needle_cases.py)."""

import random

import pytest

from kvdiag.checks.accuracy import needle
from kvdiag.checks.accuracy.needle_cases import needle_params
from kvdiag.checks.accuracy.params import AccuracyParams
from kvdiag.checks.cases import Sweep
from kvdiag.errors import UserError


def test_cell_scores_equal_a_hand_recount():
    cells = {"0": [128, 0.0], "1": [128, 0.0], "2": [128, 1.0], "3": [256, 0.0], "4": [256, 1.0], "5": [256, 1.0],
             "6": [256, 1.0], "7": [128, 1.0]}
    values = {"0": 1.0, "1": 0.0, "2": 1.0, "3": 0.0, "4": 1.0, "5": 0.0, "6": float("nan")}  # 7: not scored
    g = needle.grid(cells, values)
    assert g["lengths"] == [128, 256] and g["depths"] == [0.0, 1.0]
    # by hand: (128, 0) docs 0, 1 -> 1/2; (256, 0) doc 3 -> 0; (128, 1) doc 2 -> 1 (7 has no value);
    # (256, 1) docs 4, 5 -> 1/2 (6 is NaN)
    assert g["score"] == [[0.5, 0.0], [1.0, 0.5]]
    assert g["n"] == [[2, 1], [1, 2]]


def test_cell_scores_equal_pandas_on_random_documents():
    pd = pytest.importorskip("pandas")
    rng = random.Random(7)
    cells = {str(i): [rng.choice([64, 512, 4096]), rng.choice([0.0, 0.25, 0.5, 0.75, 1.0])] for i in range(400)}
    values = {k: float(rng.random() < 0.6) for k in cells if rng.random() < 0.9}
    g = needle.grid(cells, values)
    df = pd.DataFrame([(c[0], c[1], values[k]) for k, c in cells.items() if k in values], columns=["L", "d", "v"])
    by = df.groupby(["L", "d"])["v"].agg(["mean", "count"])
    for i, d in enumerate(g["depths"]):
        for j, n in enumerate(g["lengths"]):
            if (n, d) in by.index:
                assert g["score"][i][j] == pytest.approx(by.loc[(n, d), "mean"])
                assert g["n"][i][j] == by.loc[(n, d), "count"]
            else:
                assert g["score"][i][j] is None and g["n"][i][j] == 0


def test_the_worst_cell_is_the_largest_drop_from_the_baseline():
    base = {"lengths": [128, 256], "depths": [0.0, 1.0], "score": [[1.0, 0.25], [1.0, 1.0]], "n": [[4, 4], [4, 4]]}
    test = {"lengths": [128, 256], "depths": [0.0, 1.0], "score": [[1.0, 0.0], [0.5, 0.75]], "n": [[4, 4], [4, 4]]}
    w = needle.worst(test, base)
    # drops: (256, 0) -0.25, (128, 1) -0.5, (256, 1) -0.25: the largest is (128, depth 1), though (256, 0) is lower
    assert (w["length"], w["depth"], w["score"], w["baseline"], w["n"]) == (128, 1.0, 0.5, 1.0, 4)
    assert w["delta"] == pytest.approx(-0.5)
    alone = needle.worst(test, None)  # the baseline's own: its lowest cell
    assert (alone["length"], alone["depth"], alone["score"], alone["delta"]) == (256, 0.0, 0.0, None)
    # nothing dropped, (256, 0) rose: of the unchanged cells, the lowest, then the longest, then the deepest
    tie = {**test, "score": [[1.0, 1.0], [1.0, 1.0]]}
    assert (needle.worst(tie, base)["length"], needle.worst(tie, base)["depth"]) == (256, 1.0)
    assert needle.worst({**test, "score": [[None, None], [None, None]]}, base) is None


def _sweep(model, engine="builtin", args=None):
    return Sweep(engine, model, ["auto"], "auto", {"engine_args": args or {}})


def test_the_grid_is_sized_to_the_engine_window(tmp_path):
    from kvdiag.assets import TINY_MODEL

    p = AccuracyParams()
    got = needle_params(p, _sweep(str(TINY_MODEL)), ["kv_needle"], {"pretrained": "x"})
    assert got["metadata"]["needle_lengths"] == [128, 256, 512, 1024, 2048] == got["needle"]["lengths"]
    assert got["needle"]["window"] == 2048 and got["metadata"]["pretrained"] == "x"
    got = needle_params(p, _sweep(str(TINY_MODEL), args={"max_model_len": 1000}), ["kv_needle"], {})
    assert got["needle"]["lengths"] == [125, 250, 500, 1000]  # 1000 / 16 = 62 tokens hold no pair a depth
    assert needle_params(p, _sweep(str(TINY_MODEL)), ["kv_recall"], {}) == {}
    long = _model(tmp_path, max_position_embeddings=8192)
    got = needle_params(p, _sweep(long, args={"max_model_len": 8192}), ["kv_needle"], {})
    assert got["needle"]["lengths"][-1] == 8192
    windowed = _model(tmp_path / "w", max_position_embeddings=8192, sliding_window=512)
    assert needle_params(p, _sweep(windowed), ["kv_needle"], {})["needle"]["window"] == 512  # builtin caps it
    assert needle_params(p, _sweep(windowed, engine="vllm"), ["kv_needle"], {})["needle"]["window"] == 2048


@pytest.mark.parametrize("lengths, args, says", [
    ([4096], {}, "needle length 4096: longer than the engine's max_model_len for"),
    ([8192], {"max_model_len": 4096}, "; the model takes 8192: -a max_model_len=8192"),
    ([40], {}, "at least 63 tokens"),
])
def test_a_length_past_the_window_is_bad_input(tmp_path, lengths, args, says):
    long = _model(tmp_path, max_position_embeddings=8192)
    with pytest.raises(UserError, match=".*" + says.replace("(", r"\(").replace(")", r"\)")):
        needle_params(AccuracyParams(needle_lengths=lengths), _sweep(long, args=args), ["kv_needle"], {})


def test_needle_lengths_without_the_task_is_bad_input():
    from kvdiag.assets import TINY_MODEL

    with pytest.raises(UserError, match="add -t kv_needle"):
        needle_params(AccuracyParams(needle_lengths=[512]), _sweep(str(TINY_MODEL)), ["kv_recall"], {})
    with pytest.raises(UserError, match="needle_lengths"):
        needle_params(AccuracyParams(), _sweep(str(TINY_MODEL)), ["kv_needle"], {"needle_lengths": ["a"]})


def _model(folder, **config):
    import json

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", **config}))
    return str(folder)


def test_value_at_reads_one_cell():
    g = {"lengths": [128, 256], "depths": [0.0, 1.0], "score": [[0.1, 0.2], [0.3, 0.4]], "n": [[1, 2], [3, 4]]}
    assert needle.value_at(g, "score", 256, 1.0) == 0.4 and needle.value_at(g, "n", 128, 1.0) == 3
    assert needle.value_at(g, "score", 512, 0.0) is None and needle.value_at(None, "n", 128, 0.0) is None
