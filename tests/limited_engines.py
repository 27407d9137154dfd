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
