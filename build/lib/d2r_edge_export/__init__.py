"""The export step: checkpoints -> verified, quantized ONNX + manifest.

Imports torch/transformers/optimum; the runtime (`d2r_edge`) never imports
this package. `d2r-edge export` loads it lazily.
"""
