"""lm_eval's options of `kvdiag accuracy`, checked in the parent before any worker starts (bad input: UserError,
exit 2) and turned into what ``simple_evaluate`` takes, with lm_eval's own rules: ``--fewshot-as-multiturn`` is on
by default with a chat template and needs one; ``--metadata`` is merged over the model arguments (here
``pretrained=MODEL`` and the ``--engine-arg`` values); ``--gen-kwargs`` updates each generating task's own."""

from __future__ import annotations

import json
from pathlib import Path

from kvdiag.errors import UserError

CHAT_TEMPLATE_DEFAULT = "default"  # --apply-chat-template without a NAME: the tokenizer's (default) template
AUTO_BATCH = 1024  # requests per engine call with --batch-size auto


def lm_eval_params(p, model: str, engine_args: dict) -> dict:
    """The lm_eval part of an accuracy case's params, from AccuracyParams ``p`` and the resolved model folder."""
    template = p.apply_chat_template
    multiturn = p.fewshot_as_multiturn
    if template is not None:
        chat_template(model, template)
    if multiturn is None:
        multiturn = template is not None
    elif multiturn and template is None:
        raise UserError("--fewshot-as-multiturn needs --apply-chat-template (as in lm_eval)")
    return {"batch_size": batch_size(p.batch_size), "apply_chat_template": template,
            "fewshot_as_multiturn": multiturn, "system_instruction": p.system_instruction or None,
            "gen_kwargs": key_values("--gen-kwargs", p.gen_kwargs) or None,
            "metadata": {"pretrained": model, **engine_args, **key_values("--metadata", p.metadata)}}


def refuse_backend(model: str) -> None:
    """lm_eval's ``--model hf`` / ``--model vllm`` names its backend; kvdiag's -m/--model is the checkpoint. A value
    that is an lm_eval backend and no folder: one line pointing at --engine (UserError)."""
    if Path(model).expanduser().exists() or model not in backend_names():
        return
    raise UserError(f"--model {model}: lm_eval's --model is its backend; in kvdiag --engine/-e picks the engine "
                    "(builtin, vllm, ...) and -m/--model the checkpoint (lm_eval's pretrained=): e.g. -e vllm -m "
                    "org/name")


def backend_names() -> set[str]:
    """lm_eval's backends (hf, vllm, ...): the keys of lm_eval.models.MODEL_MAPPING, read from lm_eval's source
    (importing lm_eval costs a second); empty without lm_eval or without that table."""
    import ast
    import importlib.util

    spec = importlib.util.find_spec("lm_eval")
    if spec is None or not spec.origin:
        return set()
    try:
        tree = ast.parse((Path(spec.origin).parent / "models" / "__init__.py").read_text())
    except (OSError, SyntaxError):
        return set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "MODEL_MAPPING" for t in node.targets):
            try:
                return set(ast.literal_eval(node.value))
            except ValueError:
                return set()
    return set()


def batch_size(value) -> int:
    """Requests per engine call: an integer >= 1, or auto (AUTO_BATCH)."""
    text = str(value).strip().lower()
    if text == "auto":
        return AUTO_BATCH
    if text.isdigit() and int(text) >= 1:
        return int(text)
    raise UserError(f"--batch-size '{value}': give a whole number of requests (1, 2, ...) or auto")


def key_values(flag: str, text: str | None) -> dict:
    """A JSON object, or key=value pairs separated by commas (values typed as JSON where they parse)."""
    if text is None or not text.strip():
        return {}
    text = text.strip()
    if text.startswith("{"):
        try:
            value = json.loads(text)
        except ValueError as e:
            raise UserError(f"{flag}: not a JSON object ({e})") from None
        if not isinstance(value, dict):
            raise UserError(f"{flag}: not a JSON object")
        return value
    from kvdiag.keyvalue import parse_pairs

    return parse_pairs(flag, [text])


def chat_template(model: str, name: str) -> None:
    """Refuse --apply-chat-template on a model whose tokenizer has no chat template, or not the one named."""
    folder = Path(model)
    templates = _templates(folder)
    if not templates:
        raise UserError(f"--apply-chat-template: the tokenizer in '{folder}' has no chat template "
                        "(no chat_template in tokenizer_config.json, no chat_template.jinja)")
    if name != CHAT_TEMPLATE_DEFAULT and name not in templates:
        raise UserError(f"--apply-chat-template '{name}': the tokenizer's templates are "
                        f"{', '.join(sorted(templates))}")


def _templates(folder: Path) -> set[str]:
    """Names of the chat templates a model folder has ('default' for a single one)."""
    names: set[str] = set()
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        config = {}
    found = config.get("chat_template")
    if (folder / "chat_template.json").is_file():
        try:
            found = found or json.loads((folder / "chat_template.json").read_text()).get("chat_template")
        except (OSError, ValueError):
            pass
    if isinstance(found, list):  # [{"name": ..., "template": ...}]
        names |= {t.get("name") for t in found if isinstance(t, dict) and t.get("name")}
    elif isinstance(found, dict):
        names |= set(found)
    elif found:
        names.add(CHAT_TEMPLATE_DEFAULT)
    if (folder / "chat_template.jinja").is_file():
        names.add(CHAT_TEMPLATE_DEFAULT)
    names |= {p.stem for p in (folder / "additional_chat_templates").glob("*.jinja")}
    return names
