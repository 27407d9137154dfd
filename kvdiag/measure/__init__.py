"""Measuring memory: snapshots and the tensor census (memory.py), who holds what survives (holders.py), the
engine's processes and their GPU memory (processes.py).
"""
