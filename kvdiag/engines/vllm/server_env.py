"""What kvdiag tells the workers' fork server of a vLLM run, through its environment: the run's models (local
folders), whose architectures ``preimport.py`` inspects once. The package's ``preload_env`` writes it; ``preimport.py``
reads it here, not from the package, which names ``preimport.py`` as what the fork server imports."""

from __future__ import annotations

import json
import os

MODELS_ENV = "KVDIAG_VLLM_MODELS"  # the run's models, for the fork server's model-info warm-up (preimport.py)


def run_models() -> list[str]:
    """The models ``MODELS_ENV`` names ([] when it is unset)."""
    return json.loads(os.environ.get(MODELS_ENV) or "[]")
