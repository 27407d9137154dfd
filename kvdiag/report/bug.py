"""`kvdiag report RUN --bug CASE`: an issue body for the engine's tracker, in the shape inference engines' bug
templates share ("Your current environment", then "Describe the bug" with a minimal copy-paste script and what it
prints): the versions (kvdiag's, torch's, the device's and the engine's own, as its traits report them), the model's
shape, expected against actual, the reproducer and its output, and the kvdiag command that found it."""

from __future__ import annotations

import json
from pathlib import Path

from kvdiag.errors import UserError
from kvdiag.proof.said import proof_said

ENV_KEYS = ("torch", "cuda", "triton", "transformers", "python", "platform", "device", "driver", "gpu", "cpu_count")
CONFIG_KEYS = ("architectures", "model_type", "torch_dtype", "dtype", "num_hidden_layers", "hidden_size",
               "num_attention_heads", "num_key_value_heads", "head_dim", "sliding_window", "max_position_embeddings",
               "vocab_size")


def bug_body(run, case_id: str) -> str:
    """The issue body for the case ``case_id`` of ``run`` (UserError: no such case, or none kvdiag can prove)."""
    case = next((c for c in run.cases if c.id == case_id), None)
    if case is None:
        failing = [c.id for c in run.cases if c.status in ("fail", "crashed")]
        raise UserError(f"--bug: no case '{case_id}' in {run.run_dir}; its failing cases: "
                        + (", ".join(failing) or "none"))
    proof = case.metrics.get("proof")
    if not proof or not Path(proof["script"]).exists():
        raise UserError(f"--bug: case {case_id} has no reproducer in {run.run_dir}/repro (written for a failing case "
                        "of a check that has one, when the run proves its failures: not with --no-prove)")
    errors = [f.message for f in case.findings if f.severity == "error"]
    what = f"the {case.metrics['path']} path" if case.metrics.get("path") else case.check
    title = f"[Bug]: kv_cache_dtype={case.kv_dtype}, {what}: {case.status} ({Path(case.model).name})"
    out = [f"<!-- title: {title} -->", "", "### Your current environment", "", "<details>",
           "<summary>The versions kvdiag recorded (the run's and the case's)</summary>", "", "```text"]
    from kvdiag.engines.base import reported_versions

    env = {**run.environment, **case.environment}
    out += [f"{k}: {v}" for k, v in reported_versions(case.engine, env).items()]
    out += [f"{k}: {env[k]}" for k in ENV_KEYS if env.get(k) not in (None, "")]
    out += ["", f"model: {case.model}", f"origin: {model_origin(case.model, (run.models or {}).get(case.model))}",
            *model_shape(case.model), "```", "", "</details>", "",
            "### 🐛 Describe the bug", "",
            f"Expected: {expected(case)}", "",
            "Actual: " + ("; ".join(errors) or case.status) + ".", "",
            f"Reproduced without kvdiag: {proof_said(proof)}. The script below starts the engine alone with every "
            "argument the failing run used and carries its prompts as token ids; it exits 1 when the failure "
            "reproduces.", "",
            "```python", Path(proof["script"]).read_text().rstrip(), "```", "",
            "What it printed:", "", "```text", proof["output"].rstrip(), "```", "",
            f"Found by `{run.command}` (kvdiag {run.environment.get('kvdiag', '?')}).", ""]
    return "\n".join(out)


def expected(case) -> str:
    """What the case holds the engine to, in a sentence."""
    from kvdiag.checks.registry import get

    check = get(case.check)
    summary = (check.help.splitlines()[0] if check and check.help else case.check).rstrip(".")
    path = case.metrics.get("path")
    if path:
        return (f"the {path} path gives the same greedy tokens as the cold path of the same engine, within the "
                f"engine's own run-to-run logprob noise (tolerance {case.metrics.get('tolerance', 0):.3g})")
    return summary


def model_origin(model: str, record: dict | None) -> str:
    """Where the model comes from, as run.json's ``models`` recorded it (``evaluation.provenance``): a hub id and
    revision, a model shipped with kvdiag or built by its zoo, or a local folder; with its content hash."""
    from kvdiag.assets import ASSETS_DIR
    from kvdiag.models.zoo import zoo_cache

    record = record or {}
    path = Path(model).resolve()
    if record.get("repo_id"):
        where = f"Hugging Face hub {record['repo_id']} at revision {record.get('revision') or '?'}"
    elif path.is_relative_to(ASSETS_DIR):
        where = f"shipped with kvdiag ({path.relative_to(ASSETS_DIR.parent.parent)})"
    elif path.is_relative_to(zoo_cache().resolve()):
        where = f"built by kvdiag's model zoo (`python -m kvdiag.models.zoo`), {path.name}"
    else:
        where = "a local folder"
    return where + (f"; content {record['hash']}" if record.get("hash") else "")


def model_shape(model: str) -> list[str]:
    """The model config's shape (config.json of a local folder), a line per key; [] when there is none."""
    path = Path(model) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    text = config.get("text_config") or config
    return [f"  {k}: {text.get(k, config.get(k))}" for k in CONFIG_KEYS if text.get(k, config.get(k)) is not None]
