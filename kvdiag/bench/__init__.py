"""`kvdiag bench`: the builtin engine's Triton kernels (kvdiag.kernels) against a device copy and baselines, and
the builtin engine's decode against transformers; beside the kernels, not inside them (docs/DESIGN.md, "Layers").

- ``run.py``: a whole run and its targets; ``kernel_rows.py``: the kernels' rows; ``engine_rows.py``: the
  engine's decode tokens/s; ``measure.py``: timing, copy bandwidth, random paged batches, the SDPA baseline.
"""
