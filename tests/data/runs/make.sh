#!/usr/bin/env bash
# The run directories the table-width tests (tests/unit/test_table_widths.py) render: real runs of each command on
# the builtin engine and the shipped model, with a fault where one makes a failing row. Their run.json files are
# kept gzipped here. Run from the repository root after a change to what a run records:
#   bash tests/data/runs/make.sh
set -euo pipefail
out=$(mktemp -d)
here=tests/data/runs
k() { python3 -m kvdiag "$@" -f json -q > /dev/null || true; }  # a run with a failing row exits 1
k accuracy -d auto -d fp8 -d int8_per_token_head --limit 40 --fault v_with_k_scales -o "$out/accuracy"
k dtypes --check --fault explicit_bf16_misdispatch -o "$out/dtypes"
k memleak -d auto -d int8_per_token_head --fault global_kv_list -o "$out/memleak"
k memleak -d auto -d fp8_per_token_head -n 1 --kv-sizes 64,128 --fault per_layer_side_tensors -o "$out/memleak-kv-sizes"
k wake-cycle -d auto -d fp8 -l 1 -l 2 --fault stale_views_after_wake -o "$out/wake-cycle"
k poison -d auto -d int8_per_token_head --fault unzeroed_page_reads -o "$out/poison"
k paths -d auto -d int8_per_token_head --fault prefix_hit_treated_fresh -o "$out/paths"
k paths -d auto -d int8_per_token_head -o "$out/paths-clean"
k selftest -o "$out/selftest"
cat > "$out/suite.toml" <<'TOML'
kv_dtypes = ["auto", "fp8"]
[accuracy]
limit = 20
[memleak]
cycles = 2
TOML
k ci --config "$out/suite.toml" -o "$out/ci"
python3 -m kvdiag compare "$out/paths-clean" "$out/paths" -f json > "$out/compare.json" || true
for r in accuracy dtypes memleak memleak-kv-sizes wake-cycle poison paths paths-clean selftest ci; do
  gzip -9 -c "$out/$r/run.json" > "$here/$r.json.gz"
done
gzip -9 -c "$out/compare.json" > "$here/compare.json.gz"
rm -rf "$out"
ls -la "$here"
