"""Export registry: one spec per role (task, files, parity tolerances)."""

from __future__ import annotations

from dataclasses import dataclass

from d2r_edge.errors import UnknownRoleError
from d2r_edge.onnx.manifest import Role


@dataclass(frozen=True)
class RoleSpec:
    role: Role
    optimum_task: str          # the task optimum's exporter takes
    task: str                  # what the manifest records
    onnx_files: tuple[str, ...]
    # parity bounds (enforced: a miss raises ParityError)
    fp32_max_abs_diff: float = 1e-4
    int8_min_label_agreement: float = 0.9      # parity bound: below it the export fails
    int8_target_agreement: float = 0.99        # the int8 tier search stops at the first tier reaching it
    int8_min_cosine: float = 0.985
    fp16_max_abs_diff: float = 5e-2
    default_max_length_tokens: int = 512
    # fp16 conversion of optimum's merged decoder breaks its If-subgraph typing
    # (ORT refuses to load it), so seq2seq ships fp32 + int8 only.
    supports_fp16: bool = True


SPECS: dict[Role, RoleSpec] = {
    Role.NLI: RoleSpec(Role.NLI, "text-classification", "nli-3way", ("model.onnx",)),
    Role.RERANKER: RoleSpec(Role.RERANKER, "text-classification", "cross-encoder-relevance",
                            ("model.onnx",)),
    Role.EMBEDDER: RoleSpec(Role.EMBEDDER, "feature-extraction", "sentence-embedding-mean-pool",
                            ("model.onnx",), default_max_length_tokens=256),
    Role.TRIPLES: RoleSpec(Role.TRIPLES, "text2text-generation-with-past", "triples-rebel",
                           ("encoder_model.onnx", "decoder_model_merged.onnx"),
                           default_max_length_tokens=256, supports_fp16=False),
    # (question, passage) -> start/end logits per token; int8 agreement: the same best span
    Role.READER: RoleSpec(Role.READER, "question-answering", "extractive-qa-span", ("model.onnx",),
                          default_max_length_tokens=256),
}


def spec_for(role: str | Role) -> RoleSpec:
    try:
        return SPECS[Role(role)]
    except ValueError:
        raise UnknownRoleError(
            f"unknown role {role!r}; roles are: {', '.join(r.value for r in Role)}"
        ) from None
