#!/usr/bin/env bash
# Issue 38's device check (run through the device tool from the repository root; $OUT is set there):
#   bash benchmarks/gpu/run.sh [PROFILE_DIR]
# Wheels the image lacks travel in .whl/ (named in the tool's carry; see the device README), the profile
# (tiny: its fp16 and fp32 variants) in the carried folder given as PROFILE_DIR.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu-check}; mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site || exit 1
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
python3 -m benchmarks.gpu.driver --out "$OUT" ${1:+--models "$1"} 2>&1 | tee "$OUT/log.txt"
