"""Exhaustive check of the int8 store's rounding (kernels/store.py, quantize_rows): for every float32 y with
|y| < 130, ``trunc(y + copysign(0.5 - 2**-25, y))`` equals the reference's round-half-away-from-zero
(kernels/reference.py, round_half_away). About 2.2e9 values, under a minute on two CPU cores.

    python3 scripts/check_round.py      # prints "checked N bad 0"; exit 1 on any mismatch
"""

import sys

import numpy as np


def main() -> int:
    bad = n = 0
    hi = int(np.float32(130.0).view(np.int32))
    step = 1 << 26
    for start in range(0, hi, step):
        bits = np.arange(start, min(start + step, hi), dtype=np.int32)
        for sign in (0, -2 ** 31):
            y = (bits | np.int32(sign)).view(np.float32)
            half = ((y.view(np.uint32) & np.uint32(0x80000000)) | np.uint32(0x3EFFFFFF)).view(np.float32)
            got = (y + half).astype(np.int32)  # float32 add (round to nearest even), truncation toward zero
            t = np.trunc(y)
            want = (t + np.sign(y) * (np.abs(y - t) >= 0.5)).astype(np.int32)
            bad += int((got != want).sum())
            n += y.size
    print("checked", n, "bad", bad)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
