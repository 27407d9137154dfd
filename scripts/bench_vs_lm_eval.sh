#!/usr/bin/env bash
# kvdiag accuracy -e vllm against the loop a user writes without kvdiag (lm_eval's own vLLM backend, one process
# per kv dtype), on the same model, tasks and dtypes, on this GPU, one after the other. BENCHMARKS.md reports it.
#   bash scripts/bench_vs_lm_eval.sh OUT_DIR MODEL DTYPE [DTYPE ...]
#   KV_TASKS=kv_recall_p128,kv_recall_p176 bash scripts/bench_vs_lm_eval.sh ...   # the shipped harder tasks
#   KV_TASKS=mine KV_INCLUDE=DIR bash scripts/bench_vs_lm_eval.sh ...             # a task of your own (its YAML in DIR)
# Both sides: eager mode and the same explicit KV cache (kv_cache_memory_bytes); kvdiag's shipped recall tasks unless
# KV_TASKS (comma-separated) and KV_INCLUDE (their folder of lm_eval YAMLs) say otherwise.
set -uo pipefail
out=$1; model=$2; shift 2; dtypes=("$@")
mkdir -p "$out"
kv=$(python3 -c "from kvdiag.engines.vllm.sizing import kv_cache_bytes; print(kv_cache_bytes('$model'))")
args="enforce_eager=True,kv_cache_memory_bytes=$kv,gpu_memory_utilization=0.05,max_model_len=2048,seed=0"
include=${KV_INCLUDE:-$(python3 -c "from kvdiag.tasks import TASKS_DIR; print(TASKS_DIR)")}
tasks=${KV_TASKS:-kv_recall,kv_recall_long}
t0=$(date +%s.%N)
for d in "${dtypes[@]}"; do
  s=$(date +%s.%N)
  python3 -m lm_eval --model vllm --model_args "pretrained=$model,kv_cache_dtype=$d,$args" \
    --tasks "$tasks" --include_path "$include" --output_path "$out/lm_eval-$d" \
    > "$out/lm_eval-$d.log" 2>&1
  echo "lm_eval $d rc=$? $(python3 -c "print(round($(date +%s.%N)-$s,1))") s" | tee -a "$out/summary.txt"
done
t1=$(date +%s.%N)
dargs=(); for d in "${dtypes[@]}"; do dargs+=(-d "$d"); done
python3 -m kvdiag accuracy -e vllm -m "$model" "${dargs[@]}" -a enforce_eager=true -o "$out/kvdiag" \
  -t "$tasks" ${KV_INCLUDE:+--include-path "$KV_INCLUDE"} \
  -f json > "$out/kvdiag.json" 2> "$out/kvdiag.log"
echo "kvdiag rc=$?" | tee -a "$out/summary.txt"
t2=$(date +%s.%N)
python3 - "$out" "$tasks" "$t0" "$t1" "$t2" "${dtypes[@]}" <<'PY' | tee -a "$out/summary.txt"
import glob, json, sys
out, tasks, (t0, t1, t2), dtypes = sys.argv[1], sys.argv[2].split(","), map(float, sys.argv[3:6]), sys.argv[6:]
print(f"wall: lm_eval loop {t1 - t0:.1f} s, kvdiag {t2 - t1:.1f} s, ratio {(t1 - t0) / (t2 - t1):.2f}x")
run = json.load(open(f"{out}/kvdiag.json"))
ours = {c["kv_dtype"]: c for c in run["cases"]}
print("| dtype | " + " | ".join(f"lm_eval {t} | kvdiag {t}" for t in tasks) + " | kvdiag status |")
print("|---" * (2 * len(tasks) + 2) + "|")
for d in dtypes:
    files = sorted(glob.glob(f"{out}/lm_eval-{d}/**/results_*.json", recursive=True))
    theirs = json.load(open(files[-1]))["results"] if files else {}
    sc = (ours.get(d, {}).get("metrics") or {}).get("scores") or {}
    cell = lambda r, t: next((f"{v:.3f}" for k, v in (r.get(t) or {}).items() if k.split(",")[0] in ("acc", "exact_match") and isinstance(v, (int, float))), "-")
    mine = lambda t: next((f"{m['score']:.3f}" for k, m in (sc.get(t) or {}).items() if k in ("acc", "exact_match")), "-")
    print(f"| {d} | " + " | ".join(f"{cell(theirs, t)} | {mine(t)}" for t in tasks) + f" | {ours.get(d, {}).get('status', '-')} |")
PY
