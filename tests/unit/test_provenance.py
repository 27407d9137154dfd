"""A run is reproducible from its run.json: schema version, kvdiag's commit (git's own answer), each model's revision
and content hash, and each task's hashes (lm_eval's own task hash; the documents' hash from the data file)."""

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvdiag.assets import TINY_MODEL
from kvdiag.results import SCHEMA_VERSION, RunRecord
from kvdiag.run import provenance

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "kvdiag/tasks/data/kv_recall.jsonl"


def git(*args) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True).stdout.strip()


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def documents_hash(n: int) -> str:
    """lm_eval hashes a document as json.dumps(doc, indent=2, ensure_ascii=False): the first n of the data file."""
    rows = [json.loads(x) for x in DATA.read_text().splitlines()[:n]]
    return sha("".join(sha(json.dumps(r, indent=2, ensure_ascii=False)) for r in rows))


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("prov") / "run"
    r = subprocess.run([sys.executable, "-m", "kvdiag", "accuracy", "-d", "auto", "-d", "fp8", "-t", "kv_recall",
                        "--limit", "3", "-o", str(out), "-q"], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr
    return json.loads((out / "run.json").read_text())


def test_run_json_records_its_schema_version_and_kvdiags_commit(run):
    assert next(iter(run)) == "schema_version" and run["schema_version"] == SCHEMA_VERSION
    env = run["environment"]
    assert env["kvdiag_commit"] == git("rev-parse", "HEAD")
    assert env["kvdiag_dirty"] is bool(git("status", "--porcelain"))


def test_run_json_records_the_models_hash_and_the_tasks_hashes(run):
    model = run["models"][str(TINY_MODEL)]
    assert model["revision"] is None and model["repo_id"] is None  # a folder, not a hub snapshot
    assert model["hash"] == provenance.model_record(TINY_MODEL)["hash"] and model["hash"].startswith("sha256:")
    (task,) = run["tasks"]["kv_recall"]  # both dtypes evaluated the same documents and prompts
    assert task["cases"] == [c["id"] for c in run["cases"]] and len(task["cases"]) == 2
    assert task["documents"] == 3 and task["documents_hash"] == documents_hash(3)
    assert task["version"] == 1.0 and task["dataset"]["path"] == "json"
    for c in run["cases"]:  # each case keeps its own record
        assert c["metrics"]["lm_eval"]["tasks"]["kv_recall"]["hash"] == task["hash"]


def test_the_model_hash_follows_the_content_not_the_folder(tmp_path, monkeypatch):
    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(TINY_MODEL, a)
    shutil.copytree(TINY_MODEL, b)
    (b / "README.md").write_text("notes")
    h = provenance.model_record(a)["hash"]
    assert provenance.model_record(b)["hash"] == h
    weights = b / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 1  # one bit of one weight
    weights.write_bytes(bytes(data))
    assert provenance.model_record(b)["hash"] != h
    # a large file is hashed by its header and pieces: a change in a piece shows
    monkeypatch.setattr(provenance, "FULL_BYTES", 1024)
    h = provenance.model_record(a)["hash"]
    data = bytearray((a / "model.safetensors").read_bytes())
    data[-1] ^= 1  # inside the last piece
    (a / "model.safetensors").write_bytes(bytes(data))
    assert provenance.model_record(a)["hash"] != h


def test_a_hub_snapshot_gives_its_repository_and_revision(tmp_path):
    snap = tmp_path / "hub" / "models--org--tiny-model" / "snapshots" / "0123abcd"
    shutil.copytree(TINY_MODEL, snap)
    rec = provenance.model_record(snap)
    assert (rec["repo_id"], rec["revision"]) == ("org/tiny-model", "0123abcd")
    assert rec["hash"] == provenance.model_record(TINY_MODEL)["hash"]


def test_outside_a_git_checkout_the_commit_is_none(tmp_path, monkeypatch):
    (tmp_path / "site-packages" / "kvdiag").mkdir(parents=True)
    monkeypatch.setattr(provenance, "PACKAGE", tmp_path / "site-packages" / "kvdiag")
    assert provenance.kvdiag_git() == {"commit": None, "dirty": None}


def test_an_older_run_json_reads_without_a_schema_version():
    old = RunRecord.from_json({"command": "kvdiag accuracy", "started": "t", "cases": [], "environment": {}})
    assert old.schema_version is None and old.to_json()["schema_version"] is None
