"""d2r-edge: diagnose-and-repair for RAG on small machines.

The runtime never imports torch or transformers; see `export/` for the export step.
"""

from d2r_edge.errors import D2RError
from d2r_edge.onnx.encoders import NLI, CrossEncoder, Embedder
from d2r_edge.onnx.manifest import Manifest, Role, Variant, load_manifest
from d2r_edge.onnx.seq2seq import Triple, Triples

__all__ = [
    "D2RError", "NLI", "CrossEncoder", "Embedder", "Manifest", "Role", "Variant",
    "load_manifest", "Triple", "Triples",
]
__version__ = "0.1.0"
