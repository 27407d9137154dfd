"""What the decode experiment scripts (decode_round3.py, decode_round4.py) share: the benchmark's decode batch,
compiling every variant in worker processes, and the reference and current kernel each variant is measured
against."""

from __future__ import annotations

import functools
import multiprocessing as mp
from concurrent.futures import ProcessPoolExecutor

import torch

from kvdiag.kernels import attention, reference
from kvdiag.kernels.bench import kv_bytes, paged_batch, time_ms

SEQS, CTX, HEADS, KVH, HD, BS = 32, 4096, 32, 8, 128, 16
DTYPES = ["fp8", "int8_per_token_head", "fp8_per_token_head", "bfloat16"]


def batch(kv, dev, quick, block_size=BS):
    """`kvdiag bench`'s decode batch (32 seqs x 4096 ctx, 32/8 heads x 128); ``quick``: a tiny ragged one."""
    if quick:
        return paged_batch(kv, [1] * 4, [1, 5, 40, 70], 8, 2, 16, 4, torch.float32, dev, seed=7)
    return paged_batch(kv, [1] * SEQS, [CTX] * SEQS, HEADS, KVH, HD, block_size, torch.bfloat16, dev, seed=7)


def _warm(job, decode, ir_facts):
    kv, vs = job
    b = batch(kv, "cuda", False)
    res = []
    for v in vs:
        try:
            res.append((v, ir_facts(decode(b, v, compile_only=True)), None))
        except Exception as e:  # noqa: BLE001 - reported; the variant is skipped
            res.append((v, None, f"{type(e).__name__}: {e}"[:400]))
    torch.cuda.synchronize()
    return kv, res


def compile_variants(jobs, decode, ir_facts, workers: int) -> tuple[dict, list]:
    """Compile ``decode(b, v, compile_only=True)`` for every (kv, variants) job in ``workers`` spawned processes:
    ({(kv, variant values): ir_facts of its kernel}, [failed variants with their error])."""
    facts, errors = {}, []
    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as ex:
        for kv, res in ex.map(functools.partial(_warm, decode=decode, ir_facts=ir_facts), jobs):
            for v, f, e in res:
                if e:
                    errors.append(dict(kv=kv, **v, error=e))
                else:
                    facts[(kv, tuple(v.values()))] = f
    print(f"compiled; {len(errors)} failed", flush=True)
    return facts, errors


def reference_and_current(b, copy: float) -> tuple[torch.Tensor, int, dict]:
    """(float64 reference output, KV bytes read, {ms, x_copy} of the current paged_attention) for batch ``b``."""
    want = reference.paged_attention(*b.args()).double()
    nbytes = kv_bytes(b)
    ms = time_ms(lambda: attention.paged_attention(*b.args()))
    return want, nbytes, dict(ms=ms, x_copy=nbytes / ms / 1e6 / copy)
