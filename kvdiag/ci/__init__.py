"""kvdiag ci: the TOML config (config.py) and the suite it runs (suite.py).
"""
