"""The paths check's reshaped prompts, held to oracles computed from token counts alone: ``--lengths`` covers every
length mod the block size once, with no two prompts sharing a first block (a hit between them would make the cold
run warm); ``--long-context`` reaches N tokens; prefix-evicted's second set shares no block with the first and asks
for more blocks than the pool has left uncached."""

from __future__ import annotations

import pytest

from kvdiag.checks.paths import workload

PROMPTS = [[1] + [10 * i + k for k in range(2, 2 + n)] for i, n in enumerate((43, 40, 47, 38, 44, 41, 45, 39))]


@pytest.mark.parametrize("block", [1, 4, 16, 32])
@pytest.mark.parametrize("count", [1, 3, 8])
def test_lengths_cover_every_residue_mod_the_block_once(block, count):
    got = workload.at_every_residue(PROMPTS[:count], block)
    assert sorted(len(p) % block for p in got) == list(range(block))  # the oracle: 0..B-1, each once
    assert all(2 * block <= len(p) < 3 * block for p in got)  # at least two full blocks: a prefix can hit
    assert all(p[0] == 1 for p in got)  # each keeps its first (BOS) token
    if block > 1:
        firsts = [tuple(p[:block]) for p in got]
        assert len(set(firsts)) == len(firsts), "two prompts share a first block"


def test_long_context_reaches_n_tokens_at_several_residues():
    got = workload.long(PROMPTS, 2048)
    assert [len(p) for p in got] == [2048 + i for i in range(len(PROMPTS))]
    assert all(p[:len(q)] == q for p, q in zip(got, PROMPTS))  # grown from the prompt itself
    assert len({len(p) % 16 for p in got}) == len(PROMPTS)


@pytest.mark.parametrize("block, max_tokens", [(16, 32), (16, 12), (32, 32), (128, 32)])
def test_evicting_prompts_share_no_block_and_outnumber_the_free_blocks(block, max_tokens):
    other = workload.evicting_prompts(PROMPTS, block, max_tokens)
    firsts = {tuple(p[:block]) for p in PROMPTS}
    assert other and not any(tuple(q[:block]) in firsts for q in other)
    need = workload.needs(PROMPTS, max_tokens, block, "cpu")
    cached = sum((len(p) + max_tokens - 1) // block for p in PROMPTS)  # full blocks written per request
    uncached = need["evict_blocks"] - cached
    taken = sum(workload.blocks_for(len(q) + max_tokens, block) for q in other)
    assert taken > uncached or len(other) == len(PROMPTS)  # some cached block must be evicted
    assert need["evict_blocks"] == need["whole_blocks"] + 1  # every request at its longest, and vLLM's null block
    assert need["evict_model_len"] >= max(len(p) for p in PROMPTS) + 2 * max_tokens - 1


def test_the_prompts_run_again_last_first():
    assert workload.after_eviction(4) == [3, 2, 1, 0]
