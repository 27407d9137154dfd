"""Running cases: cases from the inputs (cases.py), the run directory and execute (orchestrate.py), where and how
many at once (scheduling.py), the worker processes (runner.py, worker.py; why one died: kvdiag/death.py), progress
lines (progress.py), shards of a suite (shards.py).
"""
