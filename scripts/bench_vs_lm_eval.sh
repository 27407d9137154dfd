#!/usr/bin/env bash
# kvdiag accuracy -e vllm against the loop a user writes without kvdiag (lm_eval's own vLLM backend, one process
# per kv dtype), on the same model, tasks and dtypes, on this GPU, one after the other. BENCHMARKS.md reports it.
#   bash scripts/bench_vs_lm_eval.sh OUT_DIR MODEL DTYPE [DTYPE ...]
# Both sides: eager mode and the same explicit KV cache (kv_cache_memory_bytes), kvdiag's shipped recall tasks.
set -uo pipefail
out=$1; model=$2; shift 2; dtypes=("$@")
mkdir -p "$out"
kv=$(python3 -c "from kvdiag.engines.vllm.sizing import kv_cache_bytes; print(kv_cache_bytes('$model'))")
args="enforce_eager=True,kv_cache_memory_bytes=$kv,gpu_memory_utilization=0.05,max_model_len=2048,seed=0"
tasks=$(python3 -c "from kvdiag.tasks import TASKS_DIR; print(TASKS_DIR)")
t0=$(date +%s.%N)
for d in "${dtypes[@]}"; do
  s=$(date +%s.%N)
  python3 -m lm_eval --model vllm --model_args "pretrained=$model,kv_cache_dtype=$d,$args" \
    --tasks kv_recall,kv_recall_long --include_path "$tasks" --output_path "$out/lm_eval-$d" \
    > "$out/lm_eval-$d.log" 2>&1
  echo "lm_eval $d rc=$? $(python3 -c "print(round($(date +%s.%N)-$s,1))") s" | tee -a "$out/summary.txt"
done
t1=$(date +%s.%N)
dargs=(); for d in "${dtypes[@]}"; do dargs+=(-d "$d"); done
python3 -m kvdiag accuracy -e vllm -m "$model" "${dargs[@]}" -a enforce_eager=true -o "$out/kvdiag" \
  -f json > "$out/kvdiag.json" 2> "$out/kvdiag.log"
echo "kvdiag rc=$?" | tee -a "$out/summary.txt"
t2=$(date +%s.%N)
python3 - "$out" "$t0" "$t1" "$t2" "${dtypes[@]}" <<'PY' | tee -a "$out/summary.txt"
import glob, json, sys
out, t0, t1, t2, dtypes = sys.argv[1], *map(float, sys.argv[2:5]), sys.argv[5:]
print(f"wall: lm_eval loop {t1 - t0:.1f} s, kvdiag {t2 - t1:.1f} s, ratio {(t1 - t0) / (t2 - t1):.2f}x")
run = json.load(open(f"{out}/kvdiag.json"))
ours = {c["kv_dtype"]: c for c in run["cases"]}
print("| dtype | lm_eval kv_recall | kvdiag kv_recall | lm_eval kv_recall_long | kvdiag kv_recall_long | kvdiag status |")
print("|---|---|---|---|---|---|")
for d in dtypes:
    files = sorted(glob.glob(f"{out}/lm_eval-{d}/**/results_*.json", recursive=True))
    theirs = json.load(open(files[-1]))["results"] if files else {}
    sc = (ours.get(d, {}).get("metrics") or {}).get("scores") or {}
    cell = lambda r, t: next((f"{v:.3f}" for k, v in (r.get(t) or {}).items() if k.startswith("acc") and "stderr" not in k and isinstance(v, (int, float))), "-")
    mine = lambda t: next((f"{m['score']:.3f}" for k, m in (sc.get(t) or {}).items() if k.startswith("acc")), "-")
    print(f"| {d} | {cell(theirs, 'kv_recall')} | {mine('kv_recall')} | {cell(theirs, 'kv_recall_long')} | "
          f"{mine('kv_recall_long')} | {ours.get(d, {}).get('status', '-')} |")
PY
