"""A stand-in for vLLM's ``LLM`` and ``SamplingParams`` for the reproducer scripts' own tests (tests/unit/
test_proof.py): put on PYTHONPATH of the script's process only. Greedy output is a function of the prompt; an engine
started with ``fake_fault="..."`` changes it as the named fault says, so a test knows which comparison must fail.

Sleep mode as vLLM's (``enable_sleep_mode=True``, ``sleep``/``wake_up``/``collective_rpc("reload_weights")``), and the
in-process engine core's block pool and cache tensors where vLLM keeps them (a script poisons free blocks there): each
request of a call takes a free block, which the engine zeroes before use as vLLM zeroes fresh blocks, unless its
fault says not. The engine core's ``shutdown()`` drops the cache, unless a leak fault keeps it (``leak_kv``), or a
tensor of 512 KiB is kept at every start (``leak_grows``); a start may launch a process no shutdown stops
and leave the garbage collector frozen (``left_behind``); a call of one request may raise
(``crash_alone``), or any call after the first (``crash_later``), or the process die in a
call of one request (``die_alone``). A KV connector as vLLM's ``ExampleConnector``
(``kv_transfer_config``'s ``shared_storage_path``): a prompt run with none stored there is stored (a file), one stored
is loaded, which its ``connector`` fault reads wrong. A request with stop strings (a generation task's) recalls: the
prompt's last word completed as the first earlier word that starts with it (kvdiag's key-value tasks: "k" of
"... kv=1 ; k" answers "v=1"), characters as tokens (``get_tokenizer``); under the ``token`` fault the answer to a
prompt whose token ids sum to an even number has its second character changed."""

from __future__ import annotations

import math
import os
from collections import OrderedDict
from types import SimpleNamespace

STARTS = []
KEPT = []  # what the leak faults keep after a shutdown


class SamplingParams:
    def __init__(self, max_tokens, temperature, logprobs, **extra):
        self.max_tokens, self.logprobs, self.extra = max_tokens, logprobs, extra


class FullAttentionSpec:  # vLLM's KV cache group specs, by name: an attention group and a state group
    def __init__(self, block_size: int):
        self.block_size = block_size


class MambaSpec:
    def __init__(self, block_size: int):
        self.block_size = block_size


class LLM:
    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.fault = kwargs.get("fake_fault") or os.environ.get("FAKE_VLLM_FAULT")  # a patch put in the process
        self.cached = OrderedDict()  # the first blocks run since the last reset: a prompt that starts so hits
        self.room = kwargs.get("num_gpu_blocks_override")  # first blocks the cache holds (None: any number)
        self.evicted = set()  # first blocks pushed out of a full cache, least recently run first
        if self.fault == "invariant_only" and os.environ.get("VLLM_BATCH_INVARIANT") != "1":
            raise ValueError("this engine starts only batch-invariant (VLLM_BATCH_INVARIANT=1)")
        if self.fault == "refuse" and kwargs.get("kv_cache_dtype", "auto") != "auto":
            raise ValueError(f"kv_cache_dtype {kwargs['kv_cache_dtype']!r} is not supported")
        if self.fault == "leak_grows":  # one more 512 KiB tensor every start, never released (under the 1 MiB a
            import torch  # script waits for while a shutdown settles)

            KEPT.append(torch.ones(1 << 19, dtype=torch.uint8))
        if self.fault == "left_behind":  # a process no shutdown stops (it ends with its parent), and the garbage
            import gc  # collector frozen at start, never unfrozen
            import subprocess
            import sys

            subprocess.Popen([sys.executable, "-c", f"import os, time\nwhile os.getppid() == {os.getpid()}: "
                              "time.sleep(0.1)"])
            gc.freeze()
        self.asleep: set[str] = set()
        self.woken = False  # a KV cache wake happened: the "wake" fault's stale block tables read wrong
        self._core = None

    @property
    def llm_engine(self):
        """vLLM's in-process engine core (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): its block pool and cache tensors;
        fault ``remote_core``: the engine core's client only, as when it runs in its own process."""
        if self.fault == "remote_core":
            return SimpleNamespace(engine_core=SimpleNamespace(shutdown=self._shutdown))
        if self._core is None:
            import torch

            n = self.kwargs.get("num_gpu_blocks_override") or 8
            blocks = [SimpleNamespace(block_id=i, ref_cnt=0, is_null=i == 0, block_hash=None) for i in range(n)]
            pool = SimpleNamespace(blocks=blocks, num_gpu_blocks=n, get_new_blocks=lambda k: blocks[-k:])
            # a hybrid's two groups: a page holds 2 tokens' K/V (the attention group's blocks), or one state (the
            # Mamba group's blocks hold max_model_len tokens); cache_config's block size is neither, as on a hybrid
            groups = [SimpleNamespace(block_pool=pool, kv_cache_spec=FullAttentionSpec(2)),
                      SimpleNamespace(block_pool=pool, kv_cache_spec=MambaSpec(64))]
            layers = {"model.layers.0.self_attn.attn": SimpleNamespace(kv_cache=[torch.zeros(n, 2, 4)], impl=None)}
            runner = SimpleNamespace(vllm_config=SimpleNamespace(
                compilation_config=SimpleNamespace(static_forward_context=layers),
                cache_config=SimpleNamespace(block_size=16)))
            self._core = SimpleNamespace(
                scheduler=SimpleNamespace(kv_cache_config=SimpleNamespace(kv_cache_groups=groups),
                                          kv_cache_manager=SimpleNamespace(
                    block_pool=pool, coordinator=SimpleNamespace(single_type_managers=groups))),
                model_executor=SimpleNamespace(driver_worker=SimpleNamespace(worker=SimpleNamespace(
                    model_runner=runner))))
        return SimpleNamespace(engine_core=SimpleNamespace(engine_core=self._core, shutdown=self._shutdown))

    def _shutdown(self):
        """The engine core's ``shutdown()``: the cache goes with the core, unless fault ``leak_kv`` keeps it (a module
        global, as vLLM's S4 bugs did)."""
        if self.fault == "leak_kv" and self._core is not None:
            KEPT.append(self._core.model_executor.driver_worker.worker.model_runner.vllm_config.compilation_config
                        .static_forward_context["model.layers.0.self_attn.attn"].kv_cache)
        self._core = None

    def sleep(self, level=1):
        if not self.kwargs.get("enable_sleep_mode"):
            raise ValueError("Sleep mode is not enabled in the model config")
        self.asleep = {"weights", "kv_cache"}

    def wake_up(self, tags=None):
        tags = set(tags or ("weights", "kv_cache"))
        if "kv_cache" in tags and self.fault == "wake_crash":
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        self.woken = self.woken or "kv_cache" in tags
        self.asleep -= tags

    def collective_rpc(self, method, *args):
        assert method == "reload_weights" and "weights" not in self.asleep
        return [None]

    def reset_prefix_cache(self):
        self.cached.clear()
        self.evicted.clear()
        return True

    def get_tokenizer(self):
        return SimpleNamespace(encode=lambda text: [ord(c) for c in text], decode=lambda ids: "".join(map(chr, ids)))

    def _recalled(self, prompt, stop, max_tokens) -> str:
        words = "".join(map(chr, prompt)).split(" ")
        answer = next((w[len(words[-1]):] for w in words[:-1] if w.startswith(words[-1]) and w != words[-1]), "")
        if self.fault == "token" and sum(prompt) % 2 == 0 and len(answer) > 1:
            answer = answer[0] + ("#" if answer[1] != "#" else "%") + answer[2:]
        for s in stop:
            answer = answer.split(s)[0]
        return answer[:max_tokens]

    def generate(self, prompts, params, use_tqdm=False):
        assert not self.asleep, "generate while asleep"
        batch = len(prompts)
        self.calls = getattr(self, "calls", 0) + 1
        if self.fault == "crash_alone" and batch == 1:  # a request running alone leaves the runner's batch
            raise IndexError("index -3 is out of bounds for dimension 0 with size 1")
        if self.fault == "die_alone" and batch == 1:  # the process dies in the call (a device abort)
            os._exit(134)
        if self.fault == "crash_later" and self.calls > 1:  # the state an earlier call left breaks a later one
            raise RuntimeError("CUDA error: device-side assert triggered")
        loaded = [self._connector(p["prompt_token_ids"]) for p in prompts]
        out = [SimpleNamespace(outputs=[self._one(p["prompt_token_ids"], params.max_tokens, batch, hit)])
               for p, hit in zip(prompts, loaded)]
        if params.extra.get("stop"):  # a generation task's request: its answer as text
            for p, o in zip(prompts, out):
                o.outputs[0].text = self._recalled(p["prompt_token_ids"], params.extra["stop"],
                                                    params.max_tokens)
        if self._core is not None:  # each request a fresh block: read unzeroed under the "poison" fault
            cache = self._core.model_executor.driver_worker.worker.model_runner.vllm_config.compilation_config \
                .static_forward_context["model.layers.0.self_attn.attn"].kv_cache[0]
            for block, o in zip(range(1, cache.shape[0]), out):
                if self.fault == "poison" and not bool(cache[block].isfinite().all()):
                    for pos in o.outputs[0].logprobs:
                        for lp in pos.values():
                            lp.logprob = math.nan
                cache[block] = math.nan if self.fault == "nan_write" else 0.5  # what the request wrote (fault
                # nan_write: NaN into the cache, the outputs unchanged)
            if self.fault == "state_block":  # a hybrid's state group writes part of its block's first slot: the
                # rest keeps what was there, which K/V read of that slot would call non-finite
                managers = self._core.scheduler.kv_cache_manager.coordinator.single_type_managers
                (b,) = managers[1].block_pool.get_new_blocks(1)
                cache[b.block_id, 0, :2] = 0.25
        for p in prompts:  # a block of 2 tokens
            key = tuple(p["prompt_token_ids"][:2])
            self.cached[key] = None
            self.cached.move_to_end(key)
            self.evicted.discard(key)
            while self.room and len(self.cached) > self.room:
                self.evicted.add(self.cached.popitem(last=False)[0])
        return out

    def _connector(self, prompt) -> bool:
        """Whether the prompt's K/V was loaded from the connector's store (else it is stored there now)."""
        config = self.kwargs.get("kv_transfer_config")
        if not config:
            return False
        store = config["kv_connector_extra_config"]["shared_storage_path"]
        name = os.path.join(store, "-".join(map(str, prompt)))
        if os.path.exists(name):
            return True
        os.makedirs(store, exist_ok=True)
        open(name, "w").close()
        return False

    def _one(self, prompt, n, batch, loaded=False):
        ids = [(sum(prompt) + 7 * i) % 101 for i in range(n)]
        if self.kwargs.get("fake_chain"):  # each token from all before it: a decode and a prefill of its tokens agree
            ids = []
            for _ in range(n):
                ids.append((3 * sum(prompt) + 3 * sum(ids) + len(prompt) + len(ids)) % 101)
        if self.fault == "window" and batch > 1:  # a batch's decode past position 4 reads a freed block's tokens
            ids[4:] = [(t + 1) % 101 for t in ids[4:]]
        lps = [-0.05 * (i + 1) for i in range(n)]
        if self.kwargs.get("fake_chain"):  # a token's logprob from the token, wherever it is decoded
            lps = [-0.05 * (1 + t % 5) for t in ids]
        if self.fault == "token" and len(prompt) % 2 == 0:  # a decided token changed at position 1
            ids[1] = (ids[1] + 1) % 101
        if self.fault == "drift":
            lps = [x - 0.2 for x in lps]
        if self.fault == "batch" and batch == 1:  # only a request alone differs
            ids[2] = (ids[2] + 1) % 101
        if self.fault == "hit" and tuple(prompt[:2]) in self.cached:  # a prefix-cache hit reads a wrong block
            ids[1] = (ids[1] + 1) % 101
        if self.fault == "evicted" and tuple(prompt[:2]) in self.evicted:  # an evicted block kept its hash: it hits
            ids[1] = (ids[1] + 1) % 101
        if self.fault == "connector" and loaded:  # K/V loaded from the connector's store into the wrong place
            ids[1] = (ids[1] + 1) % 101
        if self.fault == "nan":
            lps[0] = math.nan
        if self.fault == "wake" and self.woken:  # stale block tables after a wake: a decided token changes
            ids[1] = (ids[1] + 1) % 101
        # the runner-up token: 1.0 below the chosen one (a decided position), 0.001 at position 3 (a near-tie)
        logprobs = [{t: SimpleNamespace(logprob=lp), t + 1000: SimpleNamespace(logprob=lp - (0.001 if i == 3 else 1.0))}
                    for i, (t, lp) in enumerate(zip(ids, lps))]
        return SimpleNamespace(token_ids=ids, logprobs=logprobs)
