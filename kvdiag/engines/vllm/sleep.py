"""Which of vLLM's memory tags are asleep, and the calls that wake them the way vLLM documents.

vLLM's sleep mode (CuMemAllocator, CUDA) tags its memory ``weights`` and ``kv_cache``; a sleep at
either level puts both to sleep (level 1 offloads the weights to the CPU, level 2 discards them too).
Waking a tag that is already awake maps its memory a second time, which CUDA refuses
(``cumem_allocator.cpp``: invalid argument), so kvdiag wakes only the tags still asleep:

- level 1, everything at once: ``wake_up()``;
- level 2: ``wake_up(tags=["weights"])``, ``collective_rpc("reload_weights")`` (the weights were
  discarded: read them again from the checkpoint), then the other tags still asleep;
- staged (``weights``, then ``kv_cache``): each call wakes only its own tags, with the reload after the
  weights at level 2.
"""

from __future__ import annotations

TAGS = ("weights", "kv_cache")
RELOAD = "reload_weights"


class SleepState:
    """The level of the current sleep (0: awake) and the tags still asleep."""

    def __init__(self):
        self.level = 0
        self.asleep: set[str] = set()

    def slept(self, level: int) -> None:
        self.level, self.asleep = level, set(TAGS)

    def wake_plan(self, tags: list[str] | None = None) -> list[tuple[str, list[str] | None]]:
        """The calls that wake ``tags`` (None: every tag): ``("wake_up", tags)`` or ``("reload_weights", None)``,
        in order, each tag woken once. Nothing when those tags are awake already."""
        if tags is not None and (bad := sorted(set(tags) - set(TAGS))):
            raise ValueError(f"unknown sleep tag(s) {', '.join(bad)}; vLLM's tags: {', '.join(TAGS)}")
        want = [t for t in (TAGS if tags is None else tags) if t in self.asleep]
        if not want:
            return []
        if self.level == 1 and tags is None and self.asleep == set(TAGS):
            return [("wake_up", None)]
        plan: list[tuple[str, list[str] | None]] = []
        if "weights" in want:
            plan.append(("wake_up", ["weights"]))
            if self.level == 2:
                plan.append((RELOAD, None))
        rest = [t for t in want if t != "weights"]
        return plan + ([("wake_up", rest)] if rest else [])

    def woke(self, tags: list[str] | None) -> None:
        self.asleep -= set(TAGS if tags is None else tags)
        if not self.asleep:
            self.level = 0
