#!/usr/bin/env python3
"""A crash kvdiag recorded, shown without kvdiag.

The engine's start as kvdiag ran it (and one greedy request after it, for a crash after the start), in a fresh
process: the command below, which needs only the engine.

    python3 THIS_FILE    # exit 1: it dies again; 0: it does not
"""

import shlex
import subprocess
import sys

CASE: dict = {}  # filled in by kvdiag: the command, and what kvdiag saw


def main() -> int:
    print(f"reproducing: {CASE['title']}")
    print(f"kvdiag saw: {CASE['kvdiag_saw']}")
    argv = shlex.split(CASE["command"])
    if argv and argv[0].startswith("python"):  # the interpreter that runs this script, with its engine
        argv[0] = sys.executable
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        print("\n".join((proc.stdout + proc.stderr).splitlines()[-20:]))
        print(f"REPRODUCED: the command died (exit {proc.returncode})")
        return 1
    print("NOT REPRODUCED: the command ran to its end (exit 0)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
