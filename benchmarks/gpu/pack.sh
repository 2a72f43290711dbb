#!/usr/bin/env bash
# Issue 38: the payload the device check needs, split into parts that each fit one device call's carry
# (64 MiB with the working tree): .wp1 .. .wpN in the repository root (ignored: `/.wp*/` in .git/info/exclude).
#
#   bash benchmarks/gpu/pack.sh [OFFLINE_DIR] [TINY_DIR]      # defaults: models/offline, `.ci/models tiny`
#
# Needs network to PyPI (pip download) and an exported offline profile (fp16 + fp32 files; fp32 stays here:
# its outputs on the probe inputs travel as the reference instead).
set -euo pipefail
OFFLINE=${1:-models/offline}; TINY=${2:-$(bash .ci/models tiny)}
PART_MIB=${PART_MIB:-56}
WORK=$(mktemp -d); PAY=$WORK/pay; mkdir -p "$PAY/wheels" "$PAY/profiles"
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
# onnxruntime-gpu 1.31 is built for CUDA 13 (its CUDA provider needs libcublas.so.13), as the device image is;
# the C API library and the TensorRT provider are left out (the Python module needs neither)
# (ORT_TARBALL: reuse one made before; xz -9 takes ~4 minutes on 2 cores)
if [ -n "${ORT_TARBALL:-}" ]; then cp "$ORT_TARBALL" "$PAY/ort-cuda13.tar.xz"; else
  python3 -m pip download -q --no-deps "${PLAT[@]}" -d "$WORK" onnxruntime-gpu==1.31.1
  mkdir "$WORK/ort" && (cd "$WORK/ort" && unzip -q "$WORK"/onnxruntime_gpu-*.whl \
    && rm onnxruntime/capi/libonnxruntime.so.* onnxruntime/capi/libonnxruntime_providers_tensorrt.so \
    && tar cf - onnxruntime onnxruntime_gpu-*.dist-info | xz -9 -T0 > "$PAY/ort-cuda13.tar.xz")
fi
python3 -m pip download -q --no-deps "${PLAT[@]}" -d "$PAY/wheels" rank-bm25==0.2.2 json-repair httpx2==2.16.2 \
  httpcore2==2.16.2 truststore
python3 -m venv "$WORK/venv" && "$WORK/venv/bin/pip" install -q pybind11 numpy setuptools wheel
"$WORK/venv/bin/pip" download -q --no-deps --no-binary=:all: --no-build-isolation -d "$PAY/wheels" hnswlib==0.8.0
for name in offline tiny; do
  src=$OFFLINE; [ $name = tiny ] && src=$TINY
  dst=$PAY/profiles/$name; mkdir -p "$dst"; cp "$src/manifest.json" "$dst/"
  for role in nli reranker embedder; do
    mkdir -p "$dst/$role"; cp "$src/$role/tokenizer.json" "$dst/$role/"
    if [ $name = tiny ] && [ $role != embedder ]; then cp -r "$src/$role"/fp16 "$src/$role"/fp32 "$dst/$role/"
    elif [ $name = offline ]; then cp -r "$src/$role/fp16" "$dst/$role/"; fi
  done
done
cmp "$OFFLINE/embedder/fp16/model.onnx" "$TINY/embedder/fp16/model.onnx"   # run.sh reuses the offline file
.venv/bin/python -m benchmarks.gpu.driver --out "$WORK" --write-reference "$PAY/reference" \
  --models "$OFFLINE" --models "$TINY"
tar cf "$WORK/payload.tar" -C "$PAY" .
rm -rf .wp[0-9]*; split -b "${PART_MIB}M" -d -a 2 "$WORK/payload.tar" "$WORK/part."
i=0; sum=$(sha256sum "$WORK/payload.tar" | cut -d' ' -f1)
for p in "$WORK"/part.*; do i=$((i + 1)); mkdir -p ".wp$i"; mv "$p" ".wp$i/"; echo "$sum" > ".wp$i/SHA256"; done
ls -la .wp*/; echo "payload sha256 $sum in $i parts"; rm -rf "$WORK"
