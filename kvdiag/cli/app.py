"""The kvdiag command line. This module only registers commands, the registry's checks first; each lives in its own
module. Typer parses the command line, after lm_eval's spellings are rewritten (``lm_eval_spellings.translate``).

Heavy imports (torch, lm_eval, vllm) happen inside commands so that `kvdiag --help` is instant.
"""

from __future__ import annotations

import os
import sys
import typing
from typing import Annotated, Optional

import typer
from typer.core import TyperCommand

app = typer.Typer(
    name="kvdiag",
    help="KV-cache diagnostics and accuracy checks for LLM inference engines.\n\n"
    "Every check runs the engine in-process, one worker process per case, and writes "
    "results.jsonl + run.json into a run directory. Exit codes: 0 all passed or unsupported, "
    "1 a check failed, crashed or timed out, 2 bad input, 3 kvdiag itself failed.",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        from kvdiag.version import __version__

        typer.echo(f"kvdiag {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[Optional[bool], typer.Option("--version", "-V", callback=_version, is_eager=True,
                                                    help="Print the version and exit.")] = None,
) -> None:
    pass


# The commands: every check of the registry, in its order (kvdiag's own, then plug-ins'), then the tools. A check's
# command is made from its class (cli/check_cmd.py) unless it has a module of its own here; a command NAME of
# ``kvdiag.cli.MODULE`` is its function NAME. Command modules import only typer and kvdiag's light modules at top
# level.
OWN_MODULES = {"accuracy": "accuracy_cmd", "dtypes": "dtypes_cmd"}
TOOLS = {"bench": "bench_cmd", "ci": "ci_cmd", "report": "report_cmd", "compare": "compare_cmd",
         "selftest": "selftest_cmd"}

# an option's value as --help shows it (typer's own reads <list[str]>, <float range>): by name, else by type
METAVARS = {"engine": "ENGINE", "model": "MODEL", "kv_dtype": "DTYPE", "engine_arg": "KEY=VALUE", "output_dir": "DIR",
            "resume": "RUN_DIR", "timeout": "SECONDS", "tasks": "TASK", "include_path": "DIR", "device": "DEVICE",
            "level": "LEVEL", "paths": "PATH", "check": "CHECK", "fault": "FAULT", "only": "NAME", "shard": "K/N",
            "jobs": "N",
            "gen_kwargs": "KEY=VALUE,...", "metadata": "JSON", "mem_tolerance": "MIB", "threshold_mib": "MIB",
            "batch_size": "N|auto", "limit": "N|FRACTION", "apply_chat_template": "TEMPLATE"}
TYPE_METAVARS = {int: "N", float: "X", str: "TEXT"}


class Command(TyperCommand):
    """A typer command whose options read as a person writes them: --kv-dtype DTYPE, --timeout SECONDS."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for param in self.params:
            d = getattr(param, "type_descriptor", None)
            if d is not None and param.param_type_name == "argument" and d.is_list:  # RUN_DIR..., not <list[Path]>
                param.display_type_rich = lambda ctx: "..."
            if d is None or param.metavar is not None or getattr(param, "is_flag", False):
                continue
            if param.name in METAVARS:  # a repeatable choice too (paths --path PATH: its help lists them)
                param.metavar = METAVARS[param.name]
                continue
            if d.is_choice:
                continue
            kind = typing.get_args(d.annotation)[0] if d.is_list else d.annotation
            param.metavar = "PATH" if d.is_path else TYPE_METAVARS.get(kind, "TEXT")

    def make_parser(self, ctx):
        """click's parser, which also refuses an option that takes one value given twice: click would keep the last
        one silently (``accuracy -m A -m B`` ran only B)."""
        parser = super().make_parser(ctx)
        parse = parser.parse_args

        def once(args):
            opts, rest, order = parse(args)  # order: the parameters as given, a repeated one each time
            for p in dict.fromkeys(order):
                n = order.count(p)
                if n > 1 and p.param_type_name == "option" and not (p.multiple or p.is_flag or p.count):
                    from kvdiag.errors import UserError

                    hint = " (several models: one run each, or `kvdiag ci` with models = [...])" \
                        if "--model" in p.opts else ""
                    raise UserError(f"{'/'.join(_names(p))} given {n} times; '{self.name}' takes one value{hint}")
            return opts, rest, order

        parser.parse_args = once
        return parser

    def parse_args(self, ctx, args):
        """The parameters, then ``-a help``: the ``-a`` names of the command's engine (``-e``, else its default),
        what an unknown engine argument's error points to; nothing runs."""
        rest = super().parse_args(ctx, args)
        if "help" in (ctx.params.get("engine_arg") or ()) and "engine" in ctx.params:
            from kvdiag.engines.base import engine_arg_names

            engine = ctx.params["engine"]
            names = engine_arg_names(engine)
            typer.echo("\n".join(names) if names is not None else
                       f"engine '{engine}' does not list its arguments: -a passes them unchecked")
            ctx.exit(0)
        return rest


def _register() -> None:
    import importlib

    from kvdiag.checks.registry import checks
    from kvdiag.cli.check_cmd import command_for

    for name, check in checks().items():
        module = OWN_MODULES.get(name)
        fn = getattr(importlib.import_module(f"kvdiag.cli.{module}"), name) if module else command_for(check)
        app.command(name, cls=Command)(fn)
    for name, module in TOOLS.items():
        app.command(name, cls=Command)(getattr(importlib.import_module(f"kvdiag.cli.{module}"), name))

_register()


def _click_command(command: str | None):
    """The click command behind ``kvdiag COMMAND`` (None: no such command)."""
    import typer.main

    return getattr(typer.main.get_command(app), "commands", {}).get(command)


def _names(param) -> list[str]:
    return [*getattr(param, "opts", ()), *getattr(param, "secondary_opts", ())]


def options_of(command: str | None) -> set[str] | None:
    """The option names a command takes (None: no such command)."""
    found = _click_command(command)
    if found is None:
        return None
    return {o for p in found.params for o in _names(p)}


def main(argv: list[str] | None = None) -> None:
    """Console entry point: one line on stderr for bad input (exit 2) or an internal failure (exit 3)."""
    try:  # typer >= 0.20 vendors click
        from typer._click import exceptions as click_exc
    except ImportError:
        from click import exceptions as click_exc

    from kvdiag.cli.lm_eval_spellings import translate
    from kvdiag.errors import EXIT_BAD_INPUT, EXIT_INTERNAL, UserError

    abort = getattr(click_exc, "Abort", None)
    if abort is None:  # typer's vendored click keeps Abort in typer.exceptions
        from typer.exceptions import Abort as abort

    try:
        args = translate(sys.argv[1:] if argv is None else list(argv), options_of)
        rv = app(args=args, standalone_mode=False, prog_name="kvdiag")
    except UserError as e:
        print(f"kvdiag: error: {e}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)
    except getattr(click_exc, "NoArgsIsHelpError", ()) as e:
        print(e.ctx.get_help() if e.ctx else "", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)
    except click_exc.UsageError as e:
        hint = f" (see 'kvdiag {e.ctx.info_name} --help')" if e.ctx and e.ctx.parent else " (see 'kvdiag --help')"
        print(f"kvdiag: error: {e.format_message()}{hint}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)
    except click_exc.ClickException as e:
        print(f"kvdiag: error: {e.format_message()}", file=sys.stderr)
        sys.exit(e.exit_code)
    except abort:
        print("kvdiag: interrupted", file=sys.stderr)
        sys.exit(130)
    except KeyboardInterrupt:
        print("kvdiag: interrupted", file=sys.stderr)
        sys.exit(130)
    except BrokenPipeError:
        sys.exit(0)
    except Exception as e:  # noqa: BLE001 - kvdiag's own failure: one line, exit 3
        if os.environ.get("KVDIAG_DEBUG"):
            raise
        print(f"kvdiag: internal error: {type(e).__name__}: {e} (set KVDIAG_DEBUG=1 for the traceback)",
              file=sys.stderr)
        sys.exit(EXIT_INTERNAL)
    if rv == 130:  # typer (>= 0.2x) turns Ctrl-C into exit code 130 itself, silently
        print("kvdiag: interrupted", file=sys.stderr)
    sys.exit(rv if isinstance(rv, int) else 0)
