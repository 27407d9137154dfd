"""lm_eval (the evaluation harness) inside the accuracy check: the engine as lm_eval's LM and the task runs
(lm_eval_adapter.py), lm_eval's options (lm_eval_options.py), its results as kvdiag's scores (lm_eval_results.py),
the tasks loaded once per worker (preloaded.py), a conversation task's turns in sequence (conversation.py).
"""
