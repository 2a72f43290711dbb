#!/usr/bin/env bash
# Issue 38's device check, run through the device tool from the repository root ($OUT is set there).
#
#   bash benchmarks/gpu/pack.sh                 # here: the payload, split into .wp1 .. .wpN (each one call's carry)
#   (device) mkdir -p /tmp/parts && cp .wpK/* /tmp/parts/     # one call per part, carry [".wpK"], back to back
#   (device) bash benchmarks/gpu/run.sh          # last call (its carry: the last part): join, check, install, run
#
# The payload (benchmarks/gpu/pack.sh): onnxruntime-gpu for CUDA 13 (the image has ONNX Runtime's CPU build
# only; its wheel is ~256 MB, more than one call carries), the few pure-Python wheels the runtime needs and the
# image lacks, hnswlib's sdist (no wheel for it on PyPI; built there against the image's numpy and pybind11),
# the fp16 files of the offline and tiny profiles and the fp32 CPU reference outputs made where they were built.
# Without parts (no payload) the check still runs: every section says what it fell back to.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu-check}; mkdir -p "$OUT"
PARTS=${PARTS:-/tmp/parts}; PAY=/tmp/pay; SITE=/tmp/site
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
if compgen -G ".wp*/part.*" >/dev/null; then mkdir -p "$PARTS" && cp .wp*/part.* "$PARTS/"; fi
if compgen -G "$PARTS/part.*" >/dev/null; then
  want=$(cat "$PARTS"/SHA256 2>/dev/null || cat .wp*/SHA256 2>/dev/null | head -1)
  cat "$PARTS"/part.* > /tmp/payload.tar
  got=$(sha256sum /tmp/payload.tar | cut -d' ' -f1)
  echo "payload sha256 $got (want $want)"
  [ "$got" = "$want" ] || { echo "payload damaged or incomplete: $(ls "$PARTS")"; exit 1; }
  rm -rf "$PAY" "$SITE" && mkdir -p "$PAY" "$SITE" && tar xf /tmp/payload.tar -C "$PAY" && rm /tmp/payload.tar
  python3 -c "import tarfile,sys; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter='data')" \
    "$PAY/ort-cuda13.tar.xz" "$SITE" || exit 1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$PAY"/wheels/*.whl || exit 1
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target "$SITE" \
    "$PAY"/wheels/hnswlib-*.tar.gz > "$OUT/hnswlib-build.txt" 2>&1 || echo "hnswlib did not build (see hnswlib-build.txt)"
  # the tiny profile's embedder is the offline one's file (same sha256): carried once
  mkdir -p "$PAY/profiles/tiny/embedder/fp16" && cp "$PAY/profiles/offline/embedder/fp16/model.onnx" \
    "$PAY/profiles/tiny/embedder/fp16/"
  export PYTHONPATH="$SITE"
  # CUDA 13 libraries ONNX Runtime's CUDA provider opens (cuBLAS, cuDNN, cuRAND, cuFFT, runtime) live in the
  # image's nvidia-* wheels: on the loader path
  libs=$(python3 - <<'EOF'
import glob, os, site
dirs = set()
for root in site.getsitepackages():
    for pat in ("libcublas.so.*", "libcudnn.so.*", "libcudart.so.*", "libcurand.so.*", "libcufft.so.*",
                "libnvJitLink.so.*"):
        dirs.update(os.path.dirname(p) for p in glob.glob(f"{root}/nvidia/**/{pat}", recursive=True))
print(":".join(sorted(dirs)))
EOF
)
  export LD_LIBRARY_PATH="${libs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  echo "CUDA libraries from: $libs"
  MODELS=(--models "$PAY/profiles/tiny" --models "$PAY/profiles/offline" --reference "$PAY/reference"
          --run-models "$PAY/profiles/offline")
else
  echo "no payload parts: the check runs without ONNX Runtime's CUDA provider and without models"
  MODELS=()
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
python3 -m benchmarks.gpu.driver --out "$OUT" "${MODELS[@]}" --budget-mib "${BUDGET_MIB:-6}" 2>&1 | tee "$OUT/log.txt"
