"""d2r-edge: diagnose-and-repair for RAG on small machines.

The runtime never imports torch or transformers; see `export/` for the export step.
"""

from d2r_edge.app import RunSettings
from d2r_edge.budget import CostModel, Meter
from d2r_edge.config import Budget, ContextConfig, RewardConfig
from d2r_edge.diagnose import Diagnoser, Diagnosis, Label
from d2r_edge.errors import D2RError
from d2r_edge.hypothesis import HypothesisForm
from d2r_edge.onnx.encoders import NLI, CrossEncoder, Embedder
from d2r_edge.onnx.manifest import Manifest, Role, Variant, load_manifest
from d2r_edge.onnx.seq2seq import Triple, Triples
from d2r_edge.pipeline import Pipeline
from d2r_edge.policy import LinUCB, ThompsonSampling, reward
from d2r_edge.repair import ARMS, Arm, PipelineConfig
from d2r_edge.retrieval.kb import KnowledgeBase
from d2r_edge.retrieval.retriever import RetrievalConfig, Retriever
from d2r_edge.runtime import Result, Runtime, Verification
from d2r_edge.signals import Entailment, FailureType, KGStatus
from d2r_edge.tasks import Task

__all__ = [
    "ARMS", "Arm", "Budget", "ContextConfig", "CostModel", "CrossEncoder", "D2RError", "Diagnoser",
    "Diagnosis", "Embedder", "Entailment", "FailureType", "HypothesisForm", "KGStatus", "KnowledgeBase",
    "LinUCB", "Label",
    "Manifest", "Meter", "NLI", "Pipeline", "PipelineConfig", "RetrievalConfig", "Retriever",
    "Result", "RewardConfig", "Role", "RunSettings", "Runtime", "Task", "ThompsonSampling", "Triple", "Triples",
    "Variant", "Verification", "load_manifest", "reward",
]
__version__ = "0.1.0"
