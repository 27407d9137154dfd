"""The one thing pyproject.toml cannot say: the package list is every package under kvdiag/ (found, so that none
is left out of the wheel) plus ``kvdiag.kernels``, whose source is the top-level kernels/ (the design's layout; a
top-level ``kernels`` import package would clash with Hugging Face's ``kernels`` distribution)."""

from setuptools import find_packages, setup

setup(packages=[*find_packages(include=["kvdiag*"]), "kvdiag.kernels"], package_dir={"kvdiag.kernels": "kernels"})
