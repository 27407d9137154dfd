"""lm_eval inside kvdiag: the engine as lm_eval's LM and the task runs (lm_eval_adapter.py), lm_eval's options
(lm_eval_options.py), its results as kvdiag's scores (lm_eval_results.py), model and task hashes for run.json
(provenance.py).
"""
