"""What a run needs to be reproduced from its record (run.json): the commit of the kvdiag checkout that ran it, and
each model's revision and content hash. (The tasks' hashes come from the accuracy cases: lm_eval_adapter.task_hashes,
gathered by results.RunRecord.)

A model's hash is cheap, without reading big weights whole: sha256 over every file of the folder (subfolders
included; hidden files, README* and LICENSE* left out), in path order, of its path, its size and its bytes: all of
them for a file up to ``FULL_BYTES``, else its safetensors header (the tensors' names, dtypes, shapes and offsets)
and ``CHUNKS`` pieces of ``CHUNK_BYTES`` spread evenly over it. Another checkpoint, a changed config or tokenizer,
a re-quantized or fine-tuned weight file change it; a change confined to the unread bytes of a big file does not.
"""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

FULL_BYTES = 64 * 2**20  # files up to this size are hashed whole (configs, tokenizers, small models)
CHUNKS, CHUNK_BYTES = 16, 256 * 2**10  # pieces of a larger file hashed besides its header: 4 MiB a file
HASHED = (f"sha256 of each file's path, size and bytes (whole up to {FULL_BYTES // 2**20} MiB; larger: its "
          f"safetensors header and {CHUNKS} x {CHUNK_BYTES // 2**10} KiB spread over it)")


PACKAGE = Path(__file__).resolve().parents[1]  # kvdiag/: in a checkout, or in site-packages


def kvdiag_git() -> dict:
    """{"commit", "dirty"} of the git checkout kvdiag runs from (an editable install: ``git rev-parse HEAD`` of the
    package's folder; dirty: ``git status --porcelain`` lists a change); both None when installed otherwise."""
    root = PACKAGE.parent
    if not (root / ".git").exists():  # a folder or, in a git worktree, a file; not a site-packages in a repo
        return {"commit": None, "dirty": None}
    commit = _git(root, "rev-parse", "HEAD")
    status = _git(root, "status", "--porcelain") if commit else None
    return {"commit": commit, "dirty": None if status is None else bool(status)}


def _git(root: Path, *args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def models_record(folders) -> dict:
    """{model folder: model_record(folder)} of the distinct folders given."""
    return {str(f): model_record(f) for f in dict.fromkeys(map(str, folders))}


def model_record(folder) -> dict:
    """A model folder's hub repository and revision (a snapshot in the Hugging Face cache:
    ``models--org--name/snapshots/<commit>``; else None) and its content hash (HASHED)."""
    path = Path(folder)
    repo = revision = None
    if path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--"):
        repo, revision = path.parent.parent.name.removeprefix("models--").replace("--", "/"), path.name
    files = model_files(path)
    return {"repo_id": repo, "revision": revision, "hash": content_hash(path, files), "files": len(files),
            "bytes": sum(f.stat().st_size for f in files), "hashed": HASHED}


def model_files(path: Path) -> list[Path]:
    skip = ("README", "LICENSE")
    return sorted(f for f in path.rglob("*") if f.is_file() and not any(p.startswith(".") for p in
                                                                      f.relative_to(path).parts)
                  and not f.name.upper().startswith(skip))


def content_hash(path: Path, files: list[Path]) -> str | None:
    h = hashlib.sha256()
    try:
        for f in files:
            size = f.stat().st_size
            h.update(f"{f.relative_to(path).as_posix()}\0{size}\0".encode())
            with open(f, "rb") as fh:
                if size <= max(FULL_BYTES, CHUNKS * CHUNK_BYTES):
                    h.update(fh.read())
                    continue
                if f.suffix == ".safetensors":
                    h.update(_safetensors_header(fh))
                for i in range(CHUNKS):
                    fh.seek((size - CHUNK_BYTES) * i // (CHUNKS - 1))
                    h.update(fh.read(CHUNK_BYTES))
    except OSError:
        return None
    return "sha256:" + h.hexdigest()


def _safetensors_header(fh) -> bytes:
    """The safetensors header: 8 bytes of its length (little-endian), then that much JSON."""
    head = fh.read(8)
    n = int.from_bytes(head, "little") if len(head) == 8 else 0
    return head + fh.read(min(n, 100 * 2**20))
