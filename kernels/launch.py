"""Launching compiled Triton kernels without Triton's per-call dispatch.

``kernel[grid](...)`` costs tens of microseconds of host time per launch (triton 3.6:
binding and specializing every argument, environment-backed settings, the cache-key hash;
BENCHMARKS.md, round 1), more than the GPU time of a decode step's store or attention at small batches, and
the builtin engine launches two or three per layer per step. :class:`Launcher` keeps the
compiled kernel of each specialization it has seen and launches it directly, the way
``JITFunction.run`` itself ends (``kernel.run(grid..., stream, function, metadata, ...,
*args)``). Its key holds what Triton specializes on: the constexpr values and launch
options, each tensor's dtype and 16-byte alignment, each integer's divisibility by 16,
equality to 1 and width. A first call for a key goes through Triton (compiling if needed).

The direct path is used only when the installed Triton's ``JITFunction.run`` ends with
that exact call (checked once, from its source); otherwise, under ``TRITON_INTERPRET``, and
with ``KVDIAG_TRITON_DIRECT=0``, every call goes through ``kernel[grid](...)``.
"""

from __future__ import annotations

import functools
import inspect
import os

import torch
import triton

_CALL = ("kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, kernel.packed_metadata, launch_metadata,",
         "knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *bound_args.values())")


def _supported() -> bool:
    try:
        from triton.runtime.jit import JITFunction

        src = " ".join(inspect.getsource(JITFunction.run).split())
        return all(" ".join(c.split()) in src for c in _CALL)
    except (ImportError, OSError, TypeError, AttributeError):
        return False


SUPPORTED = _supported()
_I32, _I64 = (-(2 ** 31), 2 ** 31), (-(2 ** 63), 2 ** 63)


@functools.cache
def _sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (4 for any other device: interpreted runs)."""
    return _sms(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else 4


def cdiv(a: int, b: int) -> int:
    """``triton.cdiv`` without its constexpr-function wrapper (a few us a call on the host)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """``triton.next_power_of_2`` likewise."""
    return 1 << max(0, n - 1).bit_length()


def _spec(a):
    """What Triton specializes a runtime argument on."""
    if type(a) is int:
        return (a % 16 == 0, a == 1, _I32[0] <= a < _I32[1], _I64[0] <= a < _I64[1])
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() % 16 == 0
    return type(a)


def direct_launch() -> bool:
    """Whether :class:`Launcher` launches compiled kernels directly (see the module's docstring)."""
    return SUPPORTED and os.environ.get("KVDIAG_TRITON_DIRECT") != "0"


class Launcher:
    """``Launcher(jit_fn)(grid, args, consts, **options)`` == ``jit_fn[grid](*args, **consts, **options)``, where
    ``args`` are the runtime arguments and ``consts`` the constexpr ones, both in the kernel's parameter order
    (the runtime parameters come first)."""

    def __init__(self, fn):
        self.fn = fn
        self.kernels: dict = {}

    def __call__(self, grid, args: tuple, consts: dict, **options):
        if not direct_launch() or not isinstance(self.fn, triton.runtime.JITFunction):
            self.fn[grid](*args, **consts, **options)
            return
        from triton import knobs
        from triton.runtime import driver

        device = driver.active.get_current_device()
        key = (device, tuple(consts.values()), tuple(options.items()), tuple(map(_spec, args)))
        kernel = self.kernels.get(key)
        if kernel is None:
            assert list(consts) == self.fn.arg_names[len(args):], "constexprs must follow the runtime arguments"
            self.kernels[key] = self.fn[grid](*args, **consts, **options)
            return
        stream = driver.active.get_current_stream(device)
        values = (*args, *consts.values())
        g = (*grid, 1, 1)
        kernel.run(g[0], g[1], g[2], stream, kernel.function, kernel.packed_metadata,
                   kernel.launch_metadata(grid, stream, *values), knobs.runtime.launch_enter_hook,
                   knobs.runtime.launch_exit_hook, *values)
