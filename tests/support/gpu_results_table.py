"""A markdown table, for the docs, of the commands.jsonl that tests/gpu/test_vllm_gpu.py writes:
``python3 tests/support/gpu_results_table.py OUT/commands.jsonl``."""

from __future__ import annotations

import json
import sys


def table(lines: list[dict]) -> str:
    env = next((x["environment"] for x in lines if x.get("environment")), {}) or {}
    head = (f"vLLM {env.get('vllm', '?')}, torch {env.get('torch', '?')}, {env.get('device', '?')} "
            f"(driver {env.get('driver', '?')}), kvdiag {env.get('kvdiag', '?')}\n\n"
            "| command | exit | case | verdict | findings (severity kind) | s |\n|---|---|---|---|---|---|\n")
    rows = []
    for x in lines:
        for i, c in enumerate(x["cases"]):
            kinds = ", ".join(f"{s} {k}" for s, k, _ in c["findings"] if s != "info") or "-"
            case = c["id"].split("/", 3)[-1]
            rows.append(f"| {'`' + x['command'] + '`' if i == 0 else ''} | {x['exit_code'] if i == 0 else ''} | "
                        f"{case} | {c['status']} | {kinds} | {c['duration_s'] or 0:.0f} |")
    return head + "\n".join(rows) + "\n"


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print(table([json.loads(line) for line in f if line.strip()]), end="")
