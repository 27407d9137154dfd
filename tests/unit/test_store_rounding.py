"""The int8 store's rounding (kernels/store.py, quantize_rows): ``trunc(y + copysign(0.5 - 2**-25, y))`` in
float32 equals the reference's round-half-away-from-zero (kernels/reference.py, round_half_away) for every
float32 within 4096 ulps of each integer and each tie k + 0.5 with |k| < 130, and for a random sample of
|y| < 130. (An exhaustive run over all 2.2e9 float32 of magnitude < 130 found 0 mismatches when the
formula was written; it takes about a minute, too long for the suite.) numpy only."""

import numpy as np


def _store_round(y):
    """The store's formula, as the kernel computes it: one float32 add (round to nearest even), truncation."""
    half = ((y.view(np.uint32) & np.uint32(0x80000000)) | np.uint32(0x3EFFFFFF)).view(np.float32)
    return (y + half).astype(np.int32)


def _round_half_away(y):
    t = np.trunc(y)
    return (t + np.sign(y) * (np.abs(y - t) >= 0.5)).astype(np.int32)


def test_store_rounding_matches_round_half_away():
    anchors = np.arange(0, 130, 0.5, dtype=np.float32).view(np.int32)
    near = (anchors[:, None] + np.arange(-4096, 4097, dtype=np.int32)[None, :]).ravel()
    near = near[near >= 0].view(np.float32)
    rng = np.random.default_rng(0)
    sample = rng.uniform(0, 130, 1 << 20).astype(np.float32)
    for y in (near, sample):
        y = y[np.abs(y) < 130]
        for signed in (y, -y):
            got, want = _store_round(signed), _round_half_away(signed)
            assert np.array_equal(got, want), signed[got != want][:5]
