"""An lm_eval model over any kvdiag Engine, and running lm_eval tasks with per-document results.

``EngineLM`` follows lm_eval's ``TemplateLM`` (the same tokenization rules as
lm_eval's HFLM: trailing context spaces move to the continuation; an empty context
is conditioned on the prefix token). Every request of one lm_eval call goes to the
engine in large batches, sorted so that requests sharing a context are adjacent
(the builtin engine prefills each unique context once per ``score`` call).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import threading
import time
from itertools import groupby

from lm_eval.api.model import TemplateLM

from kvdiag.case import PROGRESS_S  # seconds between progress lines of a case
from kvdiag.checks.accuracy.harness import preloaded
from kvdiag.checks.accuracy.harness.lm_eval_results import (
    cells,
    examples,
    requests,
    summarize,
    task_groups,
    task_hashes,
)
from kvdiag.engines.protocol import EndOfText
from kvdiag.errors import UserError


class EngineLM(TemplateLM):
    def __init__(self, engine, *, max_length: int = 2048, batch_size: int = 1024, max_gen_toks: int = 256,
                 seed: int = 0, chat_tokenizer=None, on_progress=None):
        super().__init__()
        self.on_progress = on_progress  # called with a line ("120/400 documents, 35.2 doc/s") every PROGRESS_S
        self._docs, self._t0, self._shown = 0, 0.0, 0.0
        self.engine = engine
        self.tokenizer = chat_tokenizer  # a Hugging Face tokenizer: its chat template (lm_eval's chat_template())
        self._max_length = max_length
        self.batch_size = batch_size
        self.max_gen_toks = max_gen_toks
        self.seed = seed
        self.engine_seconds = 0.0  # time spent inside the engine's score/generate
        self.engine_calls = 0
        self.requests = self.truncated = self.longest = 0  # requests, those cut to max_length, the longest's tokens
        self._encode = functools.lru_cache(maxsize=8192)(lambda text: tuple(engine.encode(text)))
        bos = engine.encode("")
        self._bos = bos[0] if len(bos) == 1 else None
        self._eos = engine.eos_token_id if isinstance(engine, EndOfText) else None

    # ---- tokenization (TemplateLM's contract)
    @property
    def eot_token_id(self) -> int:
        if self._eos is None and self._bos is None:
            raise ValueError("the engine exposes neither a BOS (encode('')) nor eos_token_id")
        return self._eos if self._eos is not None else self._bos

    @property
    def prefix_token_id(self) -> int:
        return self._bos if self._bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return self.engine.name

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        ids = list(self._encode(string))
        if self._bos is not None and ids[:1] == [self._bos] and (add_special_tokens is False or ids[1:2] == ids[:1]):
            ids = ids[1:]  # a chat template writes the BOS itself: not twice (as lm_eval's vllm model)
        return ids

    # ---- chat template (lm_eval calls it with --apply-chat-template)
    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """As lm_eval's HFLM and vLLM models: the tokenizer's template; a template that refuses a system role gets
        the history without it."""
        import jinja2

        kw = {"tokenize": False, "add_generation_prompt": add_generation_prompt,
              "continue_final_message": not add_generation_prompt}
        try:
            return self.tokenizer.apply_chat_template(chat_history, **kw)
        except jinja2.exceptions.TemplateError:
            return self.tokenizer.apply_chat_template([m for m in chat_history if m["role"] != "system"], **kw)

    # ---- progress: documents done of one lm_eval call (requests scale to documents)
    def loglikelihood(self, requests, disable_tqdm: bool = False):
        self._begin(requests)
        return super().loglikelihood(requests, disable_tqdm)

    def _begin(self, requests) -> None:
        self._docs = len({(getattr(r, "task_name", None), getattr(r, "doc_id", i)) for i, r in enumerate(requests)})
        self._t0 = self._shown = time.perf_counter()
        self._done = 0

    def _advance(self, done: int, total: int) -> None:
        """A progress line at most every PROGRESS_S (and at the end): documents done, their rate, the time left."""
        now = time.perf_counter()
        if done <= self._done:  # a count that steps back (requests scored again), or one already said
            return
        self._done = done
        if self.on_progress is None or (now - self._shown < PROGRESS_S and done < total) or not total:
            return
        self._shown = now
        docs = round(self._docs * done / total)
        rate = docs / max(now - self._t0, 1e-9)
        left = f", {(self._docs - docs) / rate:.0f} s left" if 0 < docs < self._docs else ""
        self.on_progress(f"{docs:,}/{self._docs:,} documents, {rate:.1f} doc/s{left}")

    @contextlib.contextmanager
    def _counted(self, done: int, total: int):
        """An engine call whose finished requests (where the engine says them while it runs: ReportsFinished)
        move the progress on from ``done`` of ``total``, not only when it returns."""
        from kvdiag.engines.protocol import ReportsFinished

        hooked = isinstance(self.engine, ReportsFinished)
        if hooked:
            self.engine.on_finished = lambda n: self._advance(done + n, total)
        try:
            yield
        finally:
            if hooked:
                self.engine.on_finished = None

    # ---- loglikelihood
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        items = [self._fit(ctx, cont) for _, ctx, cont in requests]
        order = sorted(range(len(items)), key=lambda i: (len(items[i][0]), items[i][0]))  # similar lengths together
        out: list = [None] * len(items)
        done = 0
        for batch in self._batches(order, key=lambda i: items[i][0]):
            with self._counted(done, len(items)), self._timed():
                scored = self.engine.score([items[i][0] for i in batch], [items[i][1] for i in batch], top_k=0)
            for i, s in zip(batch, scored):
                out[i] = (float(sum(s.logprobs)), bool(s.is_greedy))
            done += len(batch)
            self._advance(done, len(items))
        for (pair, _, _), answer in zip(requests, out):
            if pair is not None:
                self.cache_hook.add_partial("loglikelihood", pair, answer)
        return out

    @contextlib.contextmanager
    def _timed(self):
        self.engine_calls += 1
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.engine_seconds += time.perf_counter() - t0

    def _count(self, tokens: int, room: int) -> None:
        self.requests += 1
        self.truncated += tokens > room
        self.longest = max(self.longest, tokens)

    def truncation(self) -> dict:
        """How many requests lost the start of their context to the engine's max length (``truncated``), of how
        many, and the longest request's tokens."""
        return {"truncated": self.truncated, "requests": self.requests, "longest": self.longest,
                "max_length": self.max_length}

    def _fit(self, ctx: list[int], cont: list[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Left-truncate so context + continuation fit the engine's max length (as HFLM does)."""
        self._count(len(ctx) + len(cont), self.max_length)
        cont = cont[-(self.max_length - 1):]
        room = self.max_length - len(cont)
        return tuple(ctx[-room:] if len(ctx) > room else ctx), tuple(cont)

    def _batches(self, order, key):
        """Chunks of about batch_size requests that never split a group of equal keys (a shared context)."""
        batch: list = []
        for _, group in groupby(order, key=key):
            group = list(group)
            if batch and len(batch) + len(group) > self.batch_size:
                yield batch
                batch = []
            batch += group
        if batch:
            yield batch

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        from lm_eval import utils

        self._begin(requests)
        windows, owner = [], []
        for r, req in enumerate(requests):
            tokens = self.tok_encode(req.args[0], add_special_tokens=False)
            for ctx, pred in map(utils.make_disjoint_window, utils.get_rolling_token_windows(
                    token_list=tokens, prefix_token=self.prefix_token_id, max_seq_len=self.max_length - 1,
                    context_len=1)):
                windows.append((None, ctx, pred))
                owner.append(r)
        totals = [0.0] * len(requests)
        for r, (ll, _) in zip(owner, self._loglikelihood_tokens(windows)):
            totals[r] += ll
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", (req.args[0],), total)
        return totals

    # ---- generation
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        from lm_eval.models.utils import normalize_gen_kwargs

        from kvdiag.checks.accuracy.harness import conversation

        self._begin(requests)
        jobs = []
        for req in requests:
            context, gen_kwargs = req.args
            kw = normalize_gen_kwargs(dict(gen_kwargs or {}), self.max_gen_toks)
            until = kw.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            jobs.append((context, tuple(until), int(kw["max_gen_toks"]), bool(kw.get("do_sample"))))
        talks = [i for i, job in enumerate(jobs) if conversation.is_conversation(job[0])]
        out: list = [None] * len(jobs)
        finished = 0
        order = sorted(set(range(len(jobs))) - set(talks), key=lambda i: jobs[i][1:])
        for kwargs, idx in groupby(order, key=lambda i: jobs[i][1:]):
            idx = list(idx)
            for start in range(0, len(idx), self.batch_size):
                chunk = idx[start:start + self.batch_size]
                with self._counted(finished, len(jobs)):
                    texts = self.complete([jobs[i][0] for i in chunk], *kwargs)
                for i, text in zip(chunk, texts):
                    out[i] = text
                finished += len(chunk)
                self._advance(finished, len(jobs))
        if talks:  # run turn by turn (conversation.py)
            answers = conversation.run(self, [jobs[i] for i in talks],
                                       lambda done: self._advance(finished + done, len(jobs)))
            for i, text in zip(talks, answers):
                out[i] = text
        for req, text in zip(requests, out):
            self.cache_hook.add_partial("generate_until", req.args, text)
        return out

    def complete(self, texts: list[str], until: tuple[str, ...], max_toks: int, sample: bool) -> list[str]:
        """One engine call: each text's completion up to its first stop string. A prompt longer than the engine's
        max length less ``max_toks`` loses its start (counted: ``truncation``)."""
        keep = max(1, self.max_length - max_toks)
        prompts = [self.tok_encode(t) for t in texts]
        for p in prompts:
            self._count(len(p), keep)
        with self._timed():
            done = self.engine.generate([p[-keep:] for p in prompts], max_toks, greedy=not sample,
                                        seed=self.seed if sample else None, stop=until)
        return [cut_at_stop(c.text or self.engine.decode(c.token_ids), until) for c in done]


def cut_at_stop(text: str, until) -> str:
    for s in until:
        if s:
            text = text.split(s)[0]
    return text


# ------------------------------------------------------------------ tasks


@functools.lru_cache(maxsize=4)
def task_manager(include_paths: tuple[str, ...] = (), include_defaults: bool = False, metadata: str | None = None):
    """:func:`kvdiag.tasks.task_manager`, built once per arguments; lm_eval's own ~15k tasks only when asked
    (indexing them takes ~7 s). ``metadata``: a JSON object for every task (--metadata)."""
    from kvdiag.tasks import task_manager as build

    return build(include_paths, include_defaults, json.loads(metadata) if metadata else None)


class _Loaded:
    """A TaskManager whose ``load`` gives the tasks the fork server loaded (``preloaded``), once, and keeps what it
    gave (``got``: lm_eval's task objects, whose scoring a generation task's reproducer carries)."""

    def __init__(self, tm, loaded):
        self._tm, self._loaded, self.got = tm, loaded, None

    def load(self, task_list):
        out, self._loaded = self._loaded, None
        self.got = out if out is not None else self._tm.load(task_list)
        return self.got

    def __getattr__(self, name):
        return getattr(self._tm, name)


def check_tasks_load(tasks: list[str], include_paths: tuple[str, ...] = (), include_defaults: bool = False,
                     metadata: dict | None = None) -> None:
    """Load the run's tasks in kvdiag's own process before any worker starts: a task whose data cannot be had (a
    dataset the hub does not give, offline and not in the Hugging Face cache; a missing file) is bad input, one
    line and exit 2 in seconds, instead of every worker trying. What it loaded stays in the Hugging Face datasets
    cache, where the workers' fork server reads it (``preloaded``)."""
    import logging

    meta = json.dumps(metadata, sort_keys=True, default=str) if metadata else None
    quiet = logging.getLogger("lm_eval")  # its notes on the task configs belong to the workers' logs, not here
    level, quiet.level = quiet.level, logging.ERROR
    try:
        task_manager(tuple(include_paths), include_defaults, meta).load(list(tasks))
    except Exception as e:  # noqa: BLE001 - whatever lm_eval or datasets raise, the user's input is the cause
        from kvdiag.errors import first_line

        offline = any(os.environ.get(v) in ("1", "true", "True") for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))
        hint = " (offline: HF_HUB_OFFLINE/HF_DATASETS_OFFLINE is set and the data is not in the Hugging Face " \
               "cache)" if offline else ""
        raise UserError(f"task(s) {', '.join(tasks)}: cannot load their data: {type(e).__name__}: "
                        f"{first_line(e)[:300]}{hint}") from None
    finally:
        quiet.setLevel(level)


def resolve_tasks(names: list[str], include_paths: tuple[str, ...] = ()) -> tuple[list[str], bool]:
    """Validate task names (globs allowed) before any worker starts.

    Returns (task names, whether lm_eval's own task index is needed). Raises UserError
    naming the first unknown task.
    """
    from pathlib import Path

    need_defaults = False
    out: list[str] = []
    for name in names:
        matched = _match(name, task_manager(include_paths))
        if not matched and not Path(name).is_file():
            matched = _match(name, task_manager(include_paths, True))
            need_defaults = need_defaults or bool(matched)
        if not matched and not Path(name).is_file():
            from kvdiag.tasks import SHIPPED_TASKS

            raise UserError(f"unknown task '{name}'; kvdiag's tasks: {', '.join(SHIPPED_TASKS)}; or any lm_eval task "
                            "name (lm_eval ls tasks), or --include-path DIR for your own YAML tasks")
        out += [m for m in matched or [name] if m not in out]
    return out, need_defaults


def _match(name: str, tm) -> list[str]:
    if any(ch in name for ch in "*?["):
        return tm.match_tasks([name])
    return [name] if name in tm.all_tasks else []


# ------------------------------------------------------------------ running


def generation_requests(res: dict, tasks: dict, lm) -> dict:
    """The generation tasks' requests per document (``lm_eval_generations.generations``) and, under ``SCORING``,
    each one's scoring, with the lengths this model generated under (prompt cut to ``max_length`` less the answer's
    tokens; ``max_gen_toks`` where a request names none)."""
    from kvdiag.checks.accuracy.harness.lm_eval_generations import SCORING, generations, scoring

    got = generations(res)
    if not got:
        return {}
    return {**got, SCORING: {t: {**scoring(tasks.get(t)), "max_length": lm.max_length,
                                 "max_gen_toks": lm.max_gen_toks} for t in got}}


def run_tasks(lm, tasks: list[str], *, include_paths: tuple[str, ...] = (), include_defaults: bool = False,
              limit: float | None = None, num_fewshot: int | None = None, seed: int = 0,
              bootstrap_iters: int = 1000, apply_chat_template: str | None = None,
              fewshot_as_multiturn: bool = False, system_instruction: str | None = None, gen_kwargs: dict | None = None,
              metadata: dict | None = None) -> dict:
    """``lm_eval.simple_evaluate`` with per-sample logging; returns ``{"scores": .., "samples": .., "settings": ..,
    "cells": .., "requests": ..}`` (``summarize``, ``cells``, ``requests``).
    ``apply_chat_template``: a template name ('default': the tokenizer's), as lm_eval's option."""
    from lm_eval import simple_evaluate

    from kvdiag.checks.accuracy.harness.lm_eval_options import CHAT_TEMPLATE_DEFAULT

    template = True if apply_chat_template == CHAT_TEMPLATE_DEFAULT else (apply_chat_template or False)
    meta = json.dumps(metadata, sort_keys=True, default=str) if metadata else None
    tm = task_manager(include_paths, include_defaults, meta)
    pre = preloaded.take(preloaded.key(tasks, include_paths, include_defaults, metadata))
    loaded = _Loaded(tm, pre)
    with _without_env_probe():
        res = simple_evaluate(model=lm, tasks=list(tasks), task_manager=loaded,
                              log_samples=True, limit=limit, num_fewshot=num_fewshot, bootstrap_iters=bootstrap_iters,
                              random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
                              fewshot_random_seed=seed, apply_chat_template=template,
                              fewshot_as_multiturn=bool(fewshot_as_multiturn), system_instruction=system_instruction,
                              gen_kwargs=dict(gen_kwargs) if gen_kwargs else None)
    out = summarize(res)
    out["cells"] = cells(res)
    out["requests"] = {**requests(res), **generation_requests(res, (loaded.got or {}).get("tasks") or {}, lm)}
    cfg = res.get("config") or {}
    out["settings"] = {"batch_size": lm.batch_size, "engine_calls": lm.engine_calls,
                       "tasks_preloaded": pre is not None, "chat_template": apply_chat_template,
                       "fewshot_as_multiturn": bool(fewshot_as_multiturn), "system_instruction": system_instruction,
                       "gen_kwargs": cfg.get("gen_kwargs"), "examples": examples(res),
                       "groups": task_groups(res.get("group_subtasks") or {}), "tasks": task_hashes(res)}
    return out


_PROBE_LOCK = threading.Lock()
_PROBE_SAVED: dict = {}  # lm_eval's own functions while any simple_evaluate runs (cases on threads: runner)
_probe_users = 0  # how many run now


@contextlib.contextmanager
def _without_env_probe():
    """Skip two probes of lm_eval 0.4.13's ``simple_evaluate`` (if this lm_eval has them); kvdiag records what they
    give in run.json another way. ``add_env_info`` runs torch's ``collect_env`` (``pip list``, compilers, drivers:
    seconds and several subprocesses per call, i.e. per kv dtype) for ``pretty_env_info``,
    and adds ``transformers_version``, ``lm_eval_version`` and ``upper_git_hash`` (the commit of the folder above the
    working directory); ``get_git_commit_hash`` is ``git describe --always`` in the working directory: the commit of
    whatever repository the user runs from, not kvdiag's nor lm_eval's. kvdiag records instead, once per run:
    the versions of torch, triton, transformers, lm_eval, vllm, the platform, devices and driver
    (``environment``), kvdiag's own commit and dirty flag (``environment.kvdiag_commit``;
    kvdiag.run.provenance), and
    per case the worker's torch and CUDA (``environment``). kvdiag reads neither field from lm_eval's results.
    Calls on several threads at once: the first one in replaces them, the last one out puts them back."""
    import lm_eval.evaluator as ev

    global _probe_users
    stubs = {"add_env_info": lambda storage: None, "get_git_commit_hash": lambda: None}
    with _PROBE_LOCK:
        if _probe_users == 0:
            _PROBE_SAVED.update({n: getattr(ev, n) for n in stubs if hasattr(ev, n)})
            for n in _PROBE_SAVED:
                setattr(ev, n, stubs[n])
        _probe_users += 1
    try:
        yield
    finally:
        with _PROBE_LOCK:
            _probe_users -= 1
            if _probe_users == 0:
                for n, f in _PROBE_SAVED.items():
                    setattr(ev, n, f)
                _PROBE_SAVED.clear()
