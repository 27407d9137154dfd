"""Assets shipped with kvdiag: the tiny recall model (see tiny-llama/README.md)."""

from pathlib import Path

ASSETS_DIR = Path(__file__).resolve().parent
TINY_MODEL = ASSETS_DIR / "tiny-llama"
