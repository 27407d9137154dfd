"""Every failure as a proof a maintainer can run: for each failing case whose check can say how (a check's
``reproducer``), a standalone script in the run directory (``repro/CASE.py``) that starts the engine with every
argument kvdiag used, carries its inputs inline, prints expected against observed and exits 1 when the failure
reproduces, 0 when it does not. kvdiag runs each in a fresh process after the run (``kvdiag/run/prove.py``) and
records the outcome on the case: ``reproduced`` yes, no, intermittent (k of n) or not run.

Files: ``fill.py`` (a script's text from what kvdiag recorded), ``said.py`` (how a proof is said), and the standalone
scripts (``*_script.py``: they import only the engine, never kvdiag)."""
