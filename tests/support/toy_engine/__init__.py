"""A toy engine: what a new engine needs to give kvdiag, in one folder, registered with one line.

Pure Python, no torch: it "generates" letters from a hash of the context and a seed (its weights), keeps a dict as
its cache, and sleeps by dropping the cache (level 1) and the seed too (level 2). It declares the runtime protocol
(``class ToyEngine(Engine)``, ``kvdiag.engines.protocol``; none of the optional capabilities there) and its traits
(``kvdiag.engines.traits.EngineTraits``: ``ToyEngine.traits``), among them one self-test fault: ``wake_reseeds``, a
wake that restores other weights (bug class S2), which wake-cycle must catch.

Registration is one line, on the command line (tests/ on PYTHONPATH)::

    kvdiag wake-cycle -e toy_engine:ToyEngine -d auto
    kvdiag selftest -e toy_engine:ToyEngine --list

(a package would register it once instead, under the ``kvdiag.engines`` entry point:
``toy = "toy_engine:ToyEngine"``).
"""

from __future__ import annotations

import zlib
from typing import Sequence

from kvdiag.engines.base import Capabilities, Completion, EngineSpec, KVBlockView, Scored
from kvdiag.engines.protocol import Engine
from kvdiag.engines.selftest import Catalogue, Fault, items
from kvdiag.engines.traits import EngineTraits

ALPHABET = "abcdefghijklmnopqrstuvwxyz "
ARG_NAMES = ["seed_offset"]  # the -a keys the toy takes
VERSION = "0.1"
_FIRED: dict[str, int] = {}  # fault -> how often its code ran in this process (the self-test's "fired")

WAKE_RESEEDS = "wake_reseeds"
NO_MEMORY_HELD = "a toy holds no memory worth measuring"
FAULTS = (
    Fault(WAKE_RESEEDS, "S2", "wake-cycle", {"wake-cycle": items(("auto", {"level": 1}))}, ("sleep",),
          "a wake restores other weights (a new seed): outputs after the wake differ from before the sleep",
          unseen={"memory": NO_MEMORY_HELD}),
)


class ToyTraits(EngineTraits):
    """What the toy tells kvdiag before any worker starts: its -a keys, its one kv dtype, its self-test, whether its
    faults fired, and the version a report names. Everything else keeps EngineTraits' defaults."""

    def engine_arg_names(self) -> list[str]:
        return list(ARG_NAMES)

    def kv_dtypes(self) -> list[str]:
        return ["auto"]

    def report_versions(self, environment: dict) -> dict:
        return {"toy_engine": VERSION}  # a real engine reads its version from the run's environment (run.json)

    def selftest(self) -> Catalogue:
        return Catalogue("toy", FAULTS)  # its cases are named by the engine as -e gave it

    def fault_state(self) -> dict:
        return {"fired": dict(_FIRED), "not_applicable": {}}


class ToyEngine(Engine):
    """kvdiag's Engine protocol over a hash: deterministic, greedy, with a sleep that must keep its seed."""

    name = "toy"
    traits = ToyTraits()

    def __init__(self):
        self.spec: EngineSpec | None = None
        self.seed: int | None = None  # the "weights"
        self.cache: dict[tuple, int] = {}  # the "KV cache": context -> next token
        self.faults: set[str] = set()
        self._kept_seed: int | None = None  # asleep at level 1: the weights kept aside

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(kv_dtypes=("auto",), sleep_levels=(1, 2), kv_access=False,
                            kv_access_reason="a toy: its cache is a Python dict", max_logprobs=len(ALPHABET))

    def start(self, spec: EngineSpec) -> None:
        unknown = set(spec.faults) - {f.name for f in FAULTS}
        if unknown:
            raise ValueError(f"unknown fault(s) of the toy engine: {', '.join(sorted(unknown))}")
        self.spec, self.faults, self.cache = spec, set(spec.faults), {}
        self.seed = spec.seed + int(spec.engine_args.get("seed_offset", 0))

    # ----- tokens ------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return [ALPHABET.index(c) if c in ALPHABET else len(ALPHABET) - 1 for c in text.lower()]

    def decode(self, token_ids: Sequence[int]) -> str:
        return "".join(ALPHABET[t % len(ALPHABET)] for t in token_ids)

    def _ids(self, prompt: str | Sequence[int]) -> list[int]:
        return self.encode(prompt) if isinstance(prompt, str) else list(prompt)

    def _scores(self, context: Sequence[int]) -> list[float]:
        """Logprobs of every next token: the hash of the context and the seed picks the favourite."""
        if self.seed is None:
            raise RuntimeError("the toy engine is asleep (level 2) or not started")
        key = tuple(context[-8:])
        if key not in self.cache:
            self.cache[key] = zlib.crc32(repr((self.seed, key)).encode()) % len(ALPHABET)
        best = self.cache[key]
        return [-0.1 if t == best else -5.0 for t in range(len(ALPHABET))]

    # ----- requests ----------------------------------------------------------------------------
    def generate(self, prompts, max_tokens: int, *, greedy: bool = True, logprobs: int = 0, seed=None,
                 stop: Sequence[str] = ()) -> list[Completion]:
        out = []
        for prompt in prompts:
            ids = self._ids(prompt)
            context, tokens, lps, tops = list(ids), [], [], []
            for _ in range(max_tokens):
                scores = self._scores(context)
                t = max(range(len(scores)), key=scores.__getitem__)
                tokens.append(t)
                lps.append(scores[t])
                if logprobs:
                    tops.append(dict(sorted(enumerate(scores), key=lambda kv: -kv[1])[:logprobs]))
                context.append(t)
            out.append(Completion(ids, tokens, lps, tops if logprobs else None, self.decode(tokens)))
        return out

    def score(self, contexts, continuations, *, top_k: int = 0) -> list[Scored]:
        out = []
        for ctx, cont in zip(contexts, continuations):
            context, lps, greedy, tops = self._ids(ctx), [], True, []
            for t in self._ids(cont):
                scores = self._scores(context)
                lps.append(scores[t])
                greedy = greedy and scores[t] == max(scores)
                if top_k > 0:
                    tops.append(dict(sorted(enumerate(scores), key=lambda kv: -kv[1])[:top_k]))
                context.append(t)
            out.append(Scored(lps, greedy, tops if top_k > 0 else None))
        return out

    # ----- sleep -------------------------------------------------------------------------------
    def sleep(self, level: int) -> None:
        self.cache = {}
        self._kept_seed = self.seed if level == 1 else None
        if level == 2:
            self.seed = None

    def wake_up(self, tags: list[str] | None = None) -> None:
        if tags is None or "weights" in tags:
            self.seed = self._kept_seed if self._kept_seed is not None else self._reload()
            if WAKE_RESEEDS in self.faults:  # the fault: the wake restores other weights
                self.seed += 1
                _FIRED[WAKE_RESEEDS] = _FIRED.get(WAKE_RESEEDS, 0) + 1

    def _reload(self) -> int:
        return self.spec.seed + int(self.spec.engine_args.get("seed_offset", 0))

    def kv_blocks(self) -> KVBlockView | None:
        return None  # no tensors: the checks that read the cache say so (kv_access_reason)

    def versions(self) -> dict[str, str]:
        return {"toy_engine": VERSION}

    def shutdown(self) -> None:
        self.cache, self.seed = {}, None
