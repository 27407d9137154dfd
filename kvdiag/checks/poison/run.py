"""The poison check in the worker: poison the free blocks, run the waves, compare with the zeroed run."""

from __future__ import annotations

from dataclasses import dataclass

from kvdiag.checks import greedy
from kvdiag.checks.common import (
    WorkloadFailed,
    device_info,
    engine_failed,
    engine_spec,
    replay_of,
    spec_starter,
    start_or_record,
)
from kvdiag.checks.kv_tensors import SlotScan
from kvdiag.checks.kv_where import on_kv
from kvdiag.checks.poison import steps
from kvdiag.checks.poison.params import PoisonParams


@dataclass
class Wave:
    prompts: list  # texts, or token ids (the wave of every length, ``--lengths``)
    max_tokens: int


def workload(prompts: list[str], block_size: int) -> list[Wave]:
    """Three waves: long decodes (two block boundaries crossed), short ones on the freed blocks,
    then everything at once."""
    return [Wave(prompts[0::2], 2 * block_size + 3), Wave(prompts[1::2], block_size // 2 + 1),
            Wave(list(prompts), block_size + 1)]


def residue_wave(model: str, texts: list[str], block_size: int) -> Wave:
    """``--lengths``: B prompts as token ids, the r-th of 2B + r tokens (every length mod the block size once:
    ``paths.workload.at_every_residue``), decoding across one block boundary."""
    from kvdiag.checks.paths.workload import at_every_residue
    from kvdiag.models import hf_tokenizer, resolve

    tok = hf_tokenizer(resolve(model))
    return Wave(at_every_residue([tok.encode(t) for t in texts], block_size), block_size + 1)


def seq_blocks(prompt, max_tokens: int, block_size: int) -> int:
    """Blocks one sequence holds at its longest (a text's tokens estimated as UTF-8 bytes + 2, an upper bound for
    byte and BPE tokenizers; token ids counted)."""
    tokens = len(prompt) if isinstance(prompt, list) else len(prompt.encode()) + 2
    return -(-(tokens + max_tokens) // block_size)


def blocks_needed(waves: list[Wave], block_size: int) -> int:
    """Blocks the largest wave holds at once: a cache of this size makes later waves reuse freed blocks."""
    return max(sum(seq_blocks(p, w.max_tokens, block_size) for p in w.prompts) for w in waves)


def longest_seq(waves: list[Wave], block_size: int) -> int:
    """Tokens of the longest sequence, in whole blocks: the ``max_model_len`` the workload needs. Not the whole
    cache: vLLM refuses to start when one sequence of ``max_model_len`` does not fit, and on a model with several
    KV cache groups (sliding and full layers: gemma3, gpt-oss) the groups share the blocks (docs/vllm-gpu-results.md,
    "Figures behind the code")."""
    return block_size * max(seq_blocks(p, w.max_tokens, block_size) for w in waves for p in w.prompts)


def run(case, ctx):
    """Case function (runner target ``kvdiag.checks.poison:run``)."""
    p = PoisonParams.from_case(case)
    spec = engine_spec(case)
    prompts = greedy.prompt_texts(case.model, case.params.get("num_prompts"))
    if spec.engine_args.get("block_size"):  # -a block_size=N: the engine's blocks, so the waves' too
        spec.block_size = int(spec.engine_args["block_size"])
    waves = workload(prompts, spec.block_size)
    if p.lengths:
        waves.append(residue_wave(case.model, prompts, spec.block_size))
    if case.params.get("num_blocks") is None and case.params.get("kv_cache_memory") is None:
        needed = blocks_needed(waves, spec.block_size)
        spec.num_blocks = needed + 1  # + the null block an engine may keep (vLLM's block 0)
        # no more sequences than a wave runs at once: vLLM's CUDA graphs of a hybrid need one Mamba block per
        # sequence, or vLLM refuses to start (docs/vllm-gpu-results.md, "Figures behind the code")
        spec.max_num_seqs = min(spec.max_num_seqs, max(len(w.prompts) for w in waves))
        if case.params.get("max_model_len") is None:
            spec.max_model_len = min(spec.max_model_len, longest_seq(waves, spec.block_size))
    if spec.prefix_caching is None:
        spec.prefix_caching = False
    ctx.stage(case, "engine start")
    engine, failed = start_or_record(case, spec_starter(spec), alone=True)
    if failed is not None:
        return failed
    rec = None
    try:
        why = steps.reachable(engine)
        if why:
            return greedy.unsupported(case, why)
        try:
            ref, _ = run_waves(engine, waves, "zero", p.seed)
        except WorkloadFailed as e:  # e.g. a device fault in vLLM's step: crashed there, with its reproducer
            rec = engine_failed(case, e.__cause__, f"workload (zero-filled reference, {e})")
            return rec
        try:
            out, stats = run_waves(engine, waves, p.value, p.seed)
        except WorkloadFailed as e:  # the clean reference ran: the engine died on the poisoned blocks
            rec = engine_failed(case, e.__cause__, f"workload (blocks poisoned with {p.value}, {e}; the "
                                "zero-filled reference ran)")
            return rec
        prompts = [q for w in waves for q in w.prompts]
        stats["workload_block_size"] = spec.block_size
        if p.lengths:
            stats["residue_wave_tokens"] = [len(q) for q in waves[-1].prompts]
        rec = _verdict(case, p, prompts, ref, out, stats, engine)
        rec.metrics.update(_replay(engine, waves, ref))
        return rec
    finally:
        try:
            engine.shutdown()
        except Exception:  # noqa: BLE001 - after a device fault the shutdown may fail too: the crash is the record
            if rec is None:
                raise


def _replay(engine, waves: list[Wave], ref) -> dict:
    """What the case's reproducer runs again (``repro.py``): the engine's start, and each wave's prompts as token
    ids with its length."""
    got = replay_of(engine, [c.prompt_token_ids for c in ref])
    if not got:
        return {}
    ids, out = iter(got["prompts"]), []
    for w in waves:
        out.append({"prompts": [next(ids) for _ in w.prompts], "max_tokens": w.max_tokens})
    return {"replay": got["replay"], "waves": out}


def run_waves(engine, waves: list[Wave], value: str, seed: int):
    """Run the waves, filling the free blocks with ``value`` before each (``steps``: where the cache is, in each
    worker process under tensor parallelism). Returns the completions (all waves, in order) and what happened to
    the cache; the engine raising in a wave is ``WorkloadFailed``."""
    outs, stats = [], {"poisoned_blocks": 0, "fresh_blocks": 0, "fresh_state_blocks": 0, "kv_slots_scanned": 0,
                       "kv_nonfinite": 0, "kv_bad_scales": 0, "kv_state_nonfinite": 0, "kv_first_bad": None}
    for n, wave in enumerate(waves):
        filled = on_kv(engine, steps.fill, value, seed + n)
        free = filled[0]["free"]
        stats.update(poisoned=filled[0]["poisoned"], num_blocks=filled[0]["num_blocks"],
                     block_size=filled[0]["block_size"], kv_processes=len(filled))
        try:
            outs += engine.generate(wave.prompts, wave.max_tokens, greedy=True)
        except Exception as e:  # noqa: BLE001 - the engine's failure is the case's record (run)
            raise WorkloadFailed(f"wave {n + 1}") from e
        scans = on_kv(engine, steps.scan, free)  # one per process; a block id is the same in each
        stats["poisoned_blocks"] += len(free)
        stats["fresh_blocks"] += len(set().union(*(s["fresh"] for s in scans)))
        stats["fresh_state_blocks"] += max(s["fresh_state_blocks"] for s in scans)
        scan = SlotScan.merged([s["scan"] for s in scans])
        stats["kv_slots_scanned"] += scan.slots
        stats["kv_nonfinite"] += scan.nonfinite
        stats["kv_bad_scales"] += scan.bad_scales
        stats["kv_state_nonfinite"] += scan.state_nonfinite
        stats["kv_first_bad"] = stats["kv_first_bad"] or (dict(scan.first, wave=n) if scan.first else None)
    return outs, stats


def _verdict(case, p: PoisonParams, prompts, ref, out, stats: dict, engine):
    diff = greedy.compare(ref, out)
    rec = case.result("pass", metrics={"value": p.value, **stats, **diff.metrics()},
                      environment={**device_info(), **engine.versions()})
    if not diff.identical:
        rec.add("error", "divergence", f"poison {p.value}: " + greedy.describe(diff, prompts, engine.decode),
                **(diff.first or {}))
    elif diff.exceeds(p.logprob_tol):
        rec.add("error", "logprob_drift", f"poison {p.value}: tokens identical but max |Δ logprob| "
                                          f"{diff.max_dlogprob:.3g} > {p.logprob_tol:g}")
    if diff.nonfinite:
        f = diff.first_nonfinite
        rec.add("error", "nan_output", f"poison {p.value}: {diff.nonfinite} non-finite logprobs; first at request "
                                       f"{f['request']} position {f['position']} ({f['logprob']})", **f)
    if stats["kv_nonfinite"] or stats["kv_bad_scales"] or stats["kv_state_nonfinite"]:
        states = f", {stats['kv_state_nonfinite']} state blocks hold NaN/Inf" if stats["poisoned"]["state_layers"] \
            else ""
        rec.add("error", "nan_kv", f"poison {p.value}: {stats['kv_nonfinite']} written KV slots hold NaN/Inf, "
                                   f"{stats['kv_bad_scales']} bad scales{states}; first at {stats['kv_first_bad']}")
    if stats["block_size"] != stats["workload_block_size"]:
        rec.add("info", "block_size", f"the waves were sized for blocks of {stats['workload_block_size']} tokens; "
                f"this engine's attention blocks hold {stats['block_size']} (its backend's own): its decodes crossed "
                "fewer block boundaries and reused fewer blocks (-a block_size=N sizes the waves for N)")
    if stats["fresh_blocks"] == 0:
        rec.add("warning", "no_fresh_blocks", f"the workload was handed out none of the {stats['poisoned_blocks']} "
                "poisoned blocks: nothing was tested")
    rec.status = "fail" if any(f.severity == "error" for f in rec.findings) else "pass"
    return rec


