"""The paths check's options (each default written once: the CLI, the config and the worker read them from here),
its cases (one per kv dtype and path) and its --help."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kvdiag.checks import greedy
from kvdiag.checks.check import option
from kvdiag.checks.paths.catalogue import DEFAULT, OPTIONAL, PATHS, REFERENCES

FLOOR_FACTOR = 4.0  # a path may move logprobs this many times the engine's own run-to-run difference


@dataclass
class PathsParams:
    paths: list[str] = option(list(DEFAULT), "--path", "-p", choices=tuple(PATHS),
                              help="Path to hold to the cold path (repeat): " + ", ".join(PATHS) + ". Default: all "
                              "but " + ", ".join(OPTIONAL) + " (two engine starts per kv dtype: name it); those the "
                              "engine or platform cannot run are reported unsupported in seconds.")
    num_prompts: int = option(8, "--num-prompts", min=2, help="Prompts of the fixed set, generated greedily in one "
                              "batch.")
    max_tokens: int = option(32, "--max-tokens", min=1, help="Tokens generated greedily per prompt.")
    logprob_tol: float = option(greedy.LOGPROB_TOL, "--logprob-tol", min=0, help="Largest |Δ logprob| a path may "
                                "add where the engine's two cold runs agree exactly.")
    floor_factor: float = option(FLOOR_FACTOR, "--floor-factor", min=1, help="A path may move logprobs this many "
                                 "times the noise floor (the engine's cold run again, in other batches, and "
                                 "recomputed).")
    lengths: bool = option(False, "--lengths", help="Prompts of every length mod the KV block size, 0 to B-1 (B "
                           "prompts of 2B to 3B-1 tokens) instead of --num-prompts prompts: where a prompt ends in "
                           "its last block.")
    long_context: int = option(0, "--long-context", min=0, help="Grow every prompt to N tokens or more (0: off; "
                               "N >= 2048 reaches long-context kernels): for the prefix, chunked-prefill and "
                               "offload paths; the model and -a max_model_len must allow N + --max-tokens.")
    batch_invariant: bool = option(False, "--batch-invariant", help="Run the reference and the path batch-invariant "
                                   "(vLLM: VLLM_BATCH_INVARIANT=1, on NVIDIA GPUs of compute capability 9.0 or "
                                   "higher; elsewhere unsupported, in vLLM's words): the floor must be 0, and any "
                                   "difference fails the path (--logprob-tol and --floor-factor do not "
                                   "apply).")
    seed: int = option(0, "--seed", help="Random seed.")
    path: str = "prefix-hit"  # this case's path (one of paths), or a reference case's name (catalogue.REFERENCES)

    @classmethod
    def from_case(cls, case) -> "PathsParams":
        return cls(**{k: case.params[k] for k in asdict(cls()) if case.params.get(k) is not None})


def variants(p: PathsParams) -> list[dict]:
    """One case per dtype and path, after the reference cases those paths are held to (``catalogue.py``)."""
    paths = list(dict.fromkeys(p.paths or DEFAULT))
    refs = [r for r in REFERENCES if any(PATHS[x].reference == r for x in paths)]
    return [{"path": name, "suffix": name} for name in refs + paths]


def spread(case):
    """A path that spans GPUs (``catalogue.SPAN``) as the scheduler must place it: the engine's own arguments for it
    (``EngineTraits.path_config`` with the visible GPUs) added to the case's, so it gets a group of GPUs; or, where
    the engine or the GPUs here cannot run it, the reason (``unsupported``), which its worker says in seconds."""
    from dataclasses import replace

    from kvdiag.engines.base import engine_traits, runs_on_gpu
    from kvdiag.gpus import visible_gpus

    path = case.params.get("path")
    device = "cuda" if runs_on_gpu(case.engine, case.params.get("device"), visible_gpus()) else "cpu"
    need = spanning(path, device)
    if not need:
        return case
    config = engine_traits(case.engine).path_config(path, {"device": device, **need})
    if isinstance(config, str):
        return replace(case, params={**case.params, "unsupported": config})
    args = {**(case.params.get("engine_args") or {}), **config.args}
    return replace(case, params={**case.params, "engine_args": args})


def spanning(path: str | None, device: str) -> dict:
    """For a path whose engine spans GPUs (``catalogue.SPAN``): the GPUs seen here (none off the GPU) and those it
    spans, as ``EngineTraits.path_config`` reads them; {} for any other path."""
    from kvdiag.checks.paths.catalogue import SPAN

    if path not in SPAN:
        return {}
    from kvdiag.gpus import visible_gpus

    return {"gpus": len(visible_gpus()) if device == "cuda" else 0, "span": SPAN[path]}


def with_references(items: list) -> list:
    """`kvdiag selftest`'s items (``kvdiag.engines.selftest.Item``) of this check, each path's reference case of its
    kv dtype and model first."""
    from kvdiag.engines.selftest import Item

    refs = [Item(it.kv_dtype, {"path": PATHS[it.params["path"]].reference}, it.model) for it in items
            if it.params.get("path") in PATHS and PATHS[it.params["path"]].reference]
    return list({it.key: it for it in refs + list(items)}.values())


def analyze(run, p: PathsParams) -> None:
    """Hold each path case that ran in an engine of its own to its reference case (verdict.analyze)."""
    from kvdiag.checks.paths.verdict import analyze as judge

    judge(run, p)


HELP = (
    "Hold every path the KV cache takes to the cold path: prefix-cache hits (also after eviction from a full pool), "
    "preemption, chunked prefill, CUDA-graph modes, speculative decoding, CPU offload, decoding past a sliding window "
    "(held to a prefill of its tokens); named only, kv-connector: K/V stored through a KV connector by one engine and "
    "loaded by another.\n"
    "\n"
    "Per kv dtype and path: the same fixed prompts run greedily cold, twice, and in another order and batch size\n"
    "(the engine's noise floor), then through the path (the same engine, or one started for it). A path fails\n"
    "when it changes a greedy token where the cold run's top two were further apart than the floor allows, or\n"
    "moves logprobs beyond the floor; the table names the first diverging token, the largest logprob difference\n"
    "and the share of prompts affected. A path the engine or platform cannot run is unsupported, in its words.\n"
    "\n"
    "Prompt shapes (options, not the default: they change every case's prompts and its time): --lengths, a prompt\n"
    "of every length mod the block size; --long-context N, prompts of N tokens and more.")
