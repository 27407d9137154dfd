"""lm_eval's spellings of kvdiag's options, so that `lm_eval run` habits carry over: ``--model_args``,
``--num_fewshot``, ``--batch_size``, ``--output_path``, ... are rewritten to kvdiag's own spelling before the command
line is parsed, for a command that has that option (hidden: ``--help`` shows kvdiag's); so are their hyphenated
spellings (``--model-args``) where kvdiag has no option of that name. lm_eval's options whose meaning differs in
kvdiag, or that kvdiag has no use for, are one line naming what to give instead (exit 2).
lm_eval's ``--model hf|vllm`` (its backend) is answered where models are resolved (lm_eval_options.backend_names).

This is the one place kvdiag reads its command line by hand (``kvdiag.cli.app.main``; the rest is Typer's): Typer
cannot do it. An option of Typer has one value or a fixed number (lm_eval's ``--model_args`` takes several words,
``--apply_chat_template`` a value or none), and its names are shown in ``--help`` (lm_eval's would double every
option there); an option Typer does not know is an error, never a hint for lm_eval's users."""

from __future__ import annotations

from kvdiag.errors import UserError

ALIASES = {  # lm_eval's spelling -> kvdiag's (the same parameter)
    "--model_args": "--engine-arg",
    "--num_fewshot": "--num-fewshot",
    "--batch_size": "--batch-size",
    "--output_path": "--output-dir",
    "--gen_kwargs": "--gen-kwargs",
    "--apply_chat_template": "--apply-chat-template",
    "--fewshot_as_multiturn": "--fewshot-as-multiturn",
    "--system_instruction": "--system-instruction",
    "--include_path": "--include-path",
}
CI_KEYS = {"--model_args": "engine_args = {key = value} at the top level or in a check's table",
           "--include_path": "include_paths = [...] in the [accuracy] table"}
SEVERAL = {"--model_args", "--gen_kwargs"}  # lm_eval takes several key=value words after these (nargs="+")
IGNORED = ("--log_samples",)  # kvdiag always keeps every document's result (artifacts/, results.samples_frame)
NO_EQUIVALENT = {  # lm_eval's options kvdiag has no use for -> what to do instead
    "--use_cache": "leave it out (every case runs the engine: kv dtypes are compared on fresh outputs)",
    "--cache_requests": "leave it out (each case builds its task requests itself)",
    "--predict_only": "leave it out (the paired tests need every document's metrics)",
    "--samples": "give --limit N (the first N documents of each task)",
    "--max_batch_size": "give --batch-size N (requests per engine call)",
}
_BOOL = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
OPTIONAL_VALUE = {"--apply-chat-template": "default"}  # alone (last, or before another option): its default value


def translate(args: list[str], options_of) -> list[str]:
    """``args`` with lm_eval's spellings replaced by kvdiag's; ``options_of(command)``: the option names that command
    takes (None for no such command). Words after ``--`` are left alone."""
    command = next((a for a in args if not a.startswith("-")), None)
    known = (options_of(command) or set()) if command else set()
    out: list[str] = []
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--":
            return out + args[i:]
        flag, eq, value = a.partition("=")
        i += 1
        if flag not in known and flag.startswith("--"):  # --model-args: lm_eval's name in kvdiag's hyphens
            flag = "--" + flag[2:].replace("-", "_")
        if flag in NO_EQUIVALENT and command and flag not in known:
            raise UserError(f"lm_eval's {flag} has no kvdiag equivalent: {NO_EQUIVALENT[flag]}")
        if flag in IGNORED and flag not in known and "--tasks" in known:  # a command that runs lm_eval
            continue
        target = ALIASES.get(flag)
        name = target if target in known else flag  # kvdiag's spelling
        if name in OPTIONAL_VALUE and name in known and not eq and (i == len(args) or args[i].startswith("-")):
            out.append(f"{name}={OPTIONAL_VALUE[name]}")
            continue
        if target is not None and target not in known and command == "ci":
            raise UserError(f"kvdiag ci reads lm_eval's {flag} from its config: "
                            f"{CI_KEYS.get(flag, flag[2:] + ' = ... in the [accuracy] table')}")
        if target is None or target not in known:
            out.append(a)
            continue
        values = [value] if eq else []
        if flag == "--fewshot_as_multiturn":
            if not eq and i < len(args) and args[i].lower() in _BOOL:
                values, i = [args[i]], i + 1
            on = _BOOL.get(values[0].lower()) if values else True
            if on is None:
                raise UserError(f"--fewshot_as_multiturn={values[0]}: give true or false (kvdiag: "
                                "--fewshot-as-multiturn / --no-fewshot-as-multiturn)")
            out.append(target if on else "--no-" + target[2:])
            continue
        if flag == "--apply_chat_template":  # with its value as the next word
            out.append(f"{target}={value}" if eq else target)
            continue
        if not eq and i < len(args):
            values, i = [args[i]], i + 1
        while flag in SEVERAL and i < len(args) and not args[i].startswith("-"):  # accuracy takes no arguments
            values, i = values + [args[i]], i + 1
        out += _rewrite(flag, target, values)
    return out


def _rewrite(flag: str, target: str, values: list[str]) -> list[str]:
    """kvdiag's words for lm_eval's ``flag`` and its values."""
    if not values:
        return [target]  # click says the value is missing
    if flag == "--model_args":
        pairs = [p for v in values for p in v.split(",")]
        given = next((p.partition("=")[2] for p in pairs if p.strip().startswith("pretrained=")), None)
        if given is not None:
            raise UserError(f"--model_args pretrained={given}: in kvdiag the checkpoint is -m/--model {given} "
                            "(--model_args / -a take the engine's own arguments)")
        return [w for v in values for w in (target, v)]
    if flag == "--gen_kwargs":
        return [target, ",".join(values)]
    if flag == "--output_path" and values[0].endswith(".json"):
        raise UserError(f"--output_path {values[0]}: kvdiag writes a run directory (run.json, results.jsonl, "
                        "reports); give -o/--output-dir DIR")
    return [target, values[0]]
