"""The generate loop of the builtin engine: admission, prefill, decode, and the KV paths real engines have.

Default (no switch): a request is admitted once the blocks of its whole length (prompt + max_tokens, capped at
max_model_len) can be reserved and its prompt fits what is left of the step's token budget; a step either prefills
the newly admitted prompts whole or decodes one token for every running request. Each switch is off by default:

- prefix caching (``EngineSpec.prefix_caching=True``): every full block whose K/V is written, by a prefill or by
  decode (as in vLLM, decode-filled blocks are cached too), is cached under the chain hash of its tokens. An
  admitted request takes the longest run of cached blocks matching its leading full blocks, at most
  ``(len(tokens) - 1) // block_size`` of them so that its last token is computed, and prefills only the rest.
- ``-a preemption=1``: admission takes only the blocks a request's tokens need now. A decode step that finds no
  free block (cached-unreferenced ones are evicted first) preempts the most recently admitted running request:
  its blocks are freed (cached ones stay cached) and it goes back to the front of the waiting queue with every
  token so far; re-admitted, it is recomputed by one prefill, after which its next token is sampled. No request is
  admitted in the step right after a decode step that preempted, so the running ones go on first.
- ``-a enable_chunked_prefill=1``: ``max_num_batched_tokens`` is not raised to max_model_len: a prompt longer than
  what is left of the step's budget is prefilled in chunks, and a token is sampled only after its last chunk.
  Prompts part-way through their prefill go on first; no decode step runs while one is.
- ``-a kv_connector_dir=DIR`` (``connector.py``): a prompt computed here has its full blocks saved to DIR; a new
  prompt whose blocks are there loads them (past any prefix-cache hit) and prefills only the rest.
"""

from __future__ import annotations

from collections import deque

from kvdiag.engines.builtin.block_manager import chain_hashes
from kvdiag.engines.builtin.sampling import Request, sample

_OFF = ("", "0", "false", "no", "off", "none")


def flag(args: dict, key: str) -> bool:
    """Whether ``-a key=...`` switches something on (absent, 0, false, no, off: not)."""
    return str(args.get(key, "")).strip().lower() not in _OFF


class Seq(Request):
    """A request of ``generate`` with what the scheduler keeps about it."""

    def __init__(self, *args):
        super().__init__(*args)
        self.computed = 0  # leading tokens whose K/V is in its blocks
        self.prefill_from = 0  # where this admission's prefill began (after a prefix-cache hit)
        self.hashes: list[bytes] = []  # chain hashes of its full blocks (prefix caching)
        self.stale: list[int] | None = None  # fault preempt_keeps_freed_blocks: the table it kept


class Scheduler:
    def __init__(self, engine, max_tokens: int, logprobs: int):
        self.engine, self.blocks, self.bs = engine, engine.blocks, engine.kv.block_size
        self.max_tokens, self.logprobs = max_tokens, logprobs
        args = engine.spec.engine_args
        self.caching = bool(engine.spec.prefix_caching)
        self.preemption = flag(args, "preemption")
        self.chunked = flag(args, "enable_chunked_prefill")
        self.budget = engine._batched_tokens if self.chunked else engine._token_budget
        self.faults, self.counters, self.fired = engine.faults, engine.counters, engine.fault_fired
        self.connector = None  # -a kv_connector_dir: prompts' full blocks saved to and loaded from files
        if args.get("kv_connector_dir"):
            from kvdiag.engines.builtin.connector import Connector

            self.connector = Connector(str(args["kv_connector_dir"]), engine.kv,
                                       self.faults.connector_load_layer_shifted)
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.prefilling: list[Seq] = []  # admitted, prompt not all computed yet (chunked prefill)
        self.reserved = 0  # blocks reserved by running requests (default admission)
        self.preempted = False  # the last decode step preempted

    def run(self, reqs: list[Seq]) -> None:
        if self.max_tokens > 0:
            self.waiting.extend(reqs)
        while self.waiting or self.running or self.prefilling:
            if not self._prefill():
                self._decode()

    # ----- prefill -------------------------------------------------------------------------------
    def _prefill(self) -> bool:
        """One prefill step: chunks under way, then newly admitted requests. False when there was nothing to run."""
        work, left = [], self.budget  # (request, tokens it computes in this step)
        for r in self.prefilling:
            if left <= 0:
                break
            work.append((r, min(len(r.tokens) - r.computed, left)))
            left -= work[-1][1]
        admitted = []
        held = len(self.running) + len(self.prefilling)
        while self.waiting and held < self.engine.spec.max_num_seqs and not (self.preempted and self.running):
            r = self.waiting[0]
            if r.stale is not None:
                self._resume_stale(r)
                held += 1
                continue
            hits = self._hits(r)
            stored = self._stored(r, len(hits))
            new = len(r.tokens) - max(len(hits), stored) * self.bs
            if not self._room(r, hits) or (work and (left <= 0 if self.chunked else new > left)):
                break
            self.waiting.popleft()
            self._admit(r, hits)
            if stored:
                self._load(r, len(hits), stored)
            work.append((r, min(new, left) if self.chunked else new))
            left -= work[-1][1]
            admitted.append(r)
            held += 1
        if not work:
            return False
        entries, own_context = [], set()
        for i, (r, n) in enumerate(work):
            entries.append((r.table, r.computed, r.tokens[r.computed:r.computed + n]))
            if r.computed > r.prefill_from or r.computed + n < len(r.tokens):  # the prompt spans several entries
                self.counters["prefill_chunks"] += 1
                if r.computed > r.prefill_from and self.faults.chunk_context_dropped:
                    own_context.add(i)
                    self.fired["chunk_context_dropped"] += 1
        last, _ = self.engine._forward(entries, last_only=True, own_context=own_context)
        for r, n in work:
            r.computed += n
            if self.caching:
                self._cache(r)
            if self.connector and r.computed == len(r.tokens) == len(r.prompt) and r.prefill_from == 0:
                self.connector.save(r.tokens, r.table)  # computed here, not loaded: what a second engine loads
        self.prefilling = [r for r in self.prefilling + admitted if r.computed < len(r.tokens)]
        rows = [i for i, (r, _) in enumerate(work) if r.computed == len(r.tokens)]
        if rows:
            done = [work[i][0] for i in rows]
            sample(done, self.engine.model.logits(last if len(rows) == len(work) else last[rows]), self.logprobs)
            self.running += done
            self._retire(done)
        return True

    def _hits(self, r: Seq) -> list[int]:
        if not self.caching:
            return []
        return self.blocks.match(chain_hashes(r.tokens, self.bs, (len(r.tokens) - 1) // self.bs, r.hashes))

    def _room(self, r: Seq, hits: list[int]) -> bool:
        if self.preemption:  # the blocks its tokens need now; hits nobody holds come off the free pool too
            taken = self.blocks.blocks_for(len(r.tokens)) - len(hits) + sum(self.blocks.refs[b] == 0 for b in hits)
            return taken <= self.blocks.num_free
        return self.reserved + self._whole(r) <= self.blocks.num_blocks

    def _whole(self, r: Seq) -> int:
        return self.blocks.blocks_for(min(len(r.tokens) + self.max_tokens, self.engine.max_model_len))

    def _admit(self, r: Seq, hits: list[int]) -> None:
        fresh = self.faults.prefix_hit_treated_fresh
        r.table = self.blocks.take(hits, fresh=fresh)  # before grow: growing may evict cached blocks
        if hits:
            self.counters["prefix_hit_tokens"] += len(hits) * self.bs
            self.fired["prefix_hit_treated_fresh"] += int(fresh)
        if not self.preemption:
            r.reserved = self._whole(r)
            self.reserved += r.reserved
        self.blocks.grow(r.table, len(r.tokens))
        r.computed = r.prefill_from = len(hits) * self.bs

    def _stored(self, r: Seq, hits: int) -> int:
        """The leading blocks of a new prompt the connector holds, where they are more than its prefix-cache hit
        (0: none to load)."""
        if self.connector is None or len(r.tokens) != len(r.prompt):
            return 0
        n = self.connector.loadable(r.tokens)
        return n if n > hits else 0

    def _load(self, r: Seq, hits: int, n: int) -> None:
        """The connector's blocks past the prefix-cache hit into the request's own: they count as computed."""
        if self.connector.load(r.tokens, r.table, hits, n):
            self.fired["connector_load_layer_shifted"] += 1
        self.counters["connector_loaded_tokens"] += (n - hits) * self.bs
        r.computed = r.prefill_from = n * self.bs

    def _cache(self, r: Seq) -> None:
        n = r.computed // self.bs
        self.blocks.cache(r.table[:n], chain_hashes(r.tokens, self.bs, n, r.hashes))

    # ----- decode --------------------------------------------------------------------------------
    def _decode(self) -> None:
        if self.preemption:
            self._make_room()
        else:
            for r in self.running:
                self.blocks.grow(r.table, len(r.tokens))
        batch = list(self.running)
        if not batch:  # _fits lets every request run alone: reaching this is a scheduler bug, not a long wait
            raise RuntimeError("generate: no request can be admitted or run")
        last, _ = self.engine._forward([(r.table, len(r.tokens) - 1, r.tokens[-1:]) for r in batch])
        for r in batch:
            r.computed = len(r.tokens)
            if self.caching and r.computed % self.bs == 0:
                self._cache(r)
        sample(batch, self.engine.model.logits(last), self.logprobs)
        self._retire(batch)

    def _make_room(self) -> None:
        """Give every running request the block its next token needs, preempting the most recently admitted
        running request while none is free (vLLM's recompute preemption)."""
        self.preempted = False
        i = 0
        while i < len(self.running):
            r = self.running[i]
            while not self.blocks.can_allocate(self.blocks.blocks_for(len(r.tokens)) - len(r.table)):
                victim = self.running.pop()
                self._preempt(victim)
                if victim is r:
                    break
            else:
                self.blocks.grow(r.table, len(r.tokens))
                i += 1

    def _preempt(self, r: Seq) -> None:
        self.counters["preemptions"] += 1
        self.engine.preempted.append((tuple(r.prompt), len(r.tokens) - len(r.prompt)))
        self.preempted = True
        if self.faults.preempt_keeps_freed_blocks:
            r.stale = list(r.table)
            self.fired["preempt_keeps_freed_blocks"] += 1
        self.blocks.free(r.table)  # cached blocks stay cached: a recompute may hit them
        r.computed = r.prefill_from = 0
        self.waiting.appendleft(r)

    def _resume_stale(self, r: Seq) -> None:
        """Fault preempt_keeps_freed_blocks: back to running on its old block ids, whatever they hold now (shared
        where another request was given one), not recomputed."""
        self.waiting.popleft()
        r.table, r.stale = self.blocks.reclaim(r.stale), None
        r.computed = len(r.tokens) - 1
        self.running.append(r)

    def _retire(self, batch: list[Seq]) -> None:
        for r in batch:
            if r.finished or len(r.tokens) >= self.engine.max_model_len:
                r.finish_reason = r.finish_reason or "length"
                self.running.remove(r)
                self.blocks.free(r.table)
                self.reserved -= r.reserved
