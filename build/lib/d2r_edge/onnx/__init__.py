"""ONNX Runtime side of d2r-edge: manifests, sessions, encoders, seq2seq decoding."""
