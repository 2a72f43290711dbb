"""PyTorch checkpoint -> ONNX fp32 (optimum), int8 per-channel (CPU), fp16 (CUDA)."""

from __future__ import annotations

import logging
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from d2r_edge.errors import ExportError, QuantizationError

log = logging.getLogger(__name__)

OPSET = 18
QUANTIZED_OPS = {"MatMulInteger", "DynamicQuantizeMatMul", "QLinearMatMul", "ConvInteger",
                 "QLinearConv", "QAttention", "DynamicQuantizeLSTM"}


@dataclass(frozen=True)
class QuantPreset:
    """Dynamic int8 quantization settings for a CPU family (weights per-channel always)."""

    name: str
    reduce_range: bool


# VNNI CPUs compute u8*s8 without saturation; plain AVX2 can saturate the
# 16-bit intermediate, which 7-bit weights (reduce_range) avoid.
PRESETS = {"avx512_vnni": QuantPreset("avx512_vnni", reduce_range=False),
           "avx2": QuantPreset("avx2", reduce_range=True),
           "arm64": QuantPreset("arm64", reduce_range=False)}


def cpu_preset() -> QuantPreset:
    """Pick the preset from the CPU flags of this machine."""
    try:
        flags = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        flags = ""
    if "avx512_vnni" in flags or "avx_vnni" in flags:
        return PRESETS["avx512_vnni"]
    if "avx2" in flags:
        return PRESETS["avx2"]
    return PRESETS["arm64"]


def to_onnx(checkpoint: Path, out: Path, optimum_task: str) -> list[Path]:
    """Export fp32 ONNX with optimum; keep only the files the runtime uses."""
    from optimum.exporters.onnx import main_export

    tmp = out.with_name(out.name + ".optimum")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        main_export(str(checkpoint), str(tmp), task=optimum_task, opset=OPSET,
                    do_validation=False, device="cpu")
    except Exception as exc:
        raise ExportError(f"optimum could not export {checkpoint}: {exc}") from exc
    out.mkdir(parents=True, exist_ok=True)
    keep = ["model.onnx", "encoder_model.onnx", "decoder_model_merged.onnx"]
    written = []
    for name in keep:
        if (tmp / name).is_file():
            shutil.move(tmp / name, out / name)
            if (tmp / (name + "_data")).is_file():  # external data of >2 GB models
                shutil.move(tmp / (name + "_data"), out / (name + "_data"))
            written.append(out / name)
    shutil.rmtree(tmp, ignore_errors=True)
    return written


def count_quantized_nodes(model_path: Path) -> int:
    """Quantized nodes in the graph and every subgraph (If branches of merged decoders)."""
    import onnx

    def walk(graph) -> int:
        total = 0
        for node in graph.node:
            total += node.op_type in QUANTIZED_OPS
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    total += walk(attr.g)
                for g in attr.graphs:
                    total += walk(g)
        return total

    return walk(onnx.load(str(model_path), load_external_data=False).graph)


@dataclass(frozen=True)
class KeepFp32:
    """A mixed-precision tier: MatMuls whose node names match these patterns stay fp32."""

    name: str
    patterns: tuple[str, ...] = ()

    def nodes(self, model_path: Path) -> list[str]:
        import onnx

        graph = onnx.load(str(model_path), load_external_data=False).graph
        return [n.name for n in graph.node
                if n.op_type == "MatMul" and any(re.search(p, n.name) for p in self.patterns)]


# Tried in order until int8 agrees with fp32 often enough (export.build). Dynamic
# int8 quantizes activations per tensor; the feed-forward down-projection reads
# GELU outputs with the widest range, so it is the first to go back to fp32.
INT8_TIERS = (KeepFp32("none"),
              KeepFp32("ffn_out", (r"layer\.\d+/output/dense/MatMul$",)),
              KeepFp32("ffn", (r"layer\.\d+/output/dense/MatMul$", r"layer\.\d+/intermediate/dense/MatMul$")))


def quantize_int8(src: Path, dst: Path, preset: QuantPreset, keep: KeepFp32 = INT8_TIERS[0]) -> int:
    """Dynamic int8, per-channel weights; returns the quantized-node count (> 0 or raises)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(
        str(src), str(dst), per_channel=True, reduce_range=preset.reduce_range,
        weight_type=QuantType.QInt8, nodes_to_exclude=keep.nodes(src) if keep.patterns else None,
        # EnableSubgraph: without it the If-branches of a merged decoder stay fp32, silently.
        extra_options={"EnableSubgraph": True, "MatMulConstBOnly": True},
    )
    n = count_quantized_nodes(dst)
    if n == 0:
        raise QuantizationError(
            f"int8 quantization of {src.name} produced no quantized node; "
            f"the graph's MatMuls may live in subgraphs the quantizer skipped"
        )
    return n


def convert_fp16(src: Path, dst: Path) -> None:
    """fp16 weights and compute for CUDA; inputs/outputs keep their fp32/int64 types."""
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    model = onnx.load(str(src))
    fp16 = convert_float_to_float16(model, keep_io_types=True, disable_shape_infer=True)
    onnx.save(fp16, str(dst))
