"""KV-cache kernels: torch references (CPU) and Triton kernels (CUDA); imported as ``kvdiag.kernels``."""
