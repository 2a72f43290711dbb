"""Fine-tune all-MiniLM-L6-v2 into the offline NLI and reranker cross-encoders.

Deterministic (seeded, single-process), CPU-only, cached by a hash of the
training data, the split rule, the base weights and the settings. The result
is an ordinary Hugging Face checkpoint that the export step then converts,
quantizes and parity-checks like any other.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from d2r_edge_export.fever_train import FILE as FEVER_TRAIN_FILE
from d2r_edge_export.finetune_data import FeverTrainSpec, PairSets, build_pairs, missing_files
from d2r_edge_export.nli_general import ID2LABEL

from d2r_edge.errors import ExportError
from d2r_edge.onnx.manifest import sha256_file

log = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")


@dataclass(frozen=True)
class FinetuneSettings:
    """The full offline build with these takes about 3 h on 2 CPU cores (README's profile table), of which the
    reader's cloze stage ~60 min and its QA spans ~7 min."""

    nli_epochs: int = 3
    rerank_epochs: int = 2
    nli_learning_rate: float = 1e-4
    rerank_learning_rate: float = 7e-5
    batch_size: int = 32                 # NLI pairs per step
    rerank_queries_per_batch: int = 4    # reranker: queries per step, each with its passages
    rerank_negatives: int = 3            # negatives sampled per query and step
    rerank_fever_groups: int = 400       # FEVER claims among the reranker's queries
    max_length_tokens: int = 128
    warmup_fraction: float = 0.1
    seed: int = 0
    max_train_pairs: int | None = None
    # NLI only: bfloat16 autocast, ~1.5x faster steps on CPUs with avx512_bf16/AMX ("auto" uses
    # it there). The reranker always trains in fp32: its listwise scores in bf16 cost 8 points
    # of held-out recall@3 (0.706 vs 0.786, same data and seed, measured here). The NLI in fp32
    # scored 0.738 vs 0.735 in bf16 (same seed, from the same reranker) at twice the step time.
    nli_bf16: str = "auto"
    # NLI only: one synthetic pair per training FEVER claim (negation flip or number swap)
    nli_augment: bool = True
    # where each role's encoder starts: "base" (the MiniLM) or the other role's fine-tuned
    # checkpoint with a new head. The NLI started from the reranker scored +1.9 / +1.8 points
    # of held-out accuracy over the base (seeds 0 / 1, measured here); the reranker started
    # from the NLI +2.0 / -1.6 points of recall@3, so it starts from the base
    nli_init: str = "reranker"
    rerank_init: str = "base"
    # NLI first stage: the general-domain pairs of ../shared/data/nli (export/nli_general.py),
    # then the FEVER/QA pairs above from that checkpoint. 0 epochs: FEVER/QA pairs only
    nli_general_epochs: int = 1
    nli_general_learning_rate: float = 1e-4
    nli_general_sources: str = "all"        # "all", "all,-SOURCE,...", or "SOURCE,SOURCE,..."
    # NLI FEVER/QA stage: this many pairs from FEVER 1.0 train (../shared/data/fever_train; 0: none),
    # premises titled by the claim's subject ("bare", "subject" or "drop"; export/fever_train.py).
    # 10,000: the knee of the learning curve in docs/results.md (0 -> 10k: +5.2 points, 10k -> 30k:
    # +1.0 for twice the steps); 3 epochs of them add ~940 steps to the build
    nli_fever_train_pairs: int = 10000
    nli_fever_titles: str = "subject"
    nli_fever_max_sentences: int = 2
    # QA files (finetune_data.QA_FILES) whose questions neither role sees, from any file: an
    # evaluation may test on every question of them (`eval answers --split all`), not only on
    # the ~20% held-out side. Recorded in the manifest (each role's training.split)
    exclude_files: tuple[str, ...] = ()
    # the reader (issue 53): MiniLM with a span head on the QA samples' questions (export/reader_data.py),
    # each positive passage with `reader_negatives` no-answer passages of the same question
    reader_epochs: int = 3
    reader_learning_rate: float = 5e-5
    reader_batch_size: int = 16
    reader_max_length_tokens: int = 256     # question + passage: multi-hop paragraphs run to ~200 tokens
    reader_negatives: int = 1
    # the reader's first stage: this many FEVER-train cloze questions (export/reader_cloze.py; 0: none),
    # each with `reader_negatives` no-answer passages, for `reader_cloze_epochs` passes before the QA spans.
    # on 102 held-out questions of the other QA files (a BM25 title baseline: EM 0.059): none EM 0.049 / F1
    # 0.109; 16,000 (2,000 steps, ~22 min on 2 cores) 0.088 / 0.218; 32,000 (4,000 steps, ~59 min) 0.147 / 0.250,
    # chosen by that validation (HotpotQA detection's training CV 0.665 vs 0.662 with 16,000; docs/results.md)
    reader_cloze_examples: int = 32000
    reader_cloze_epochs: int = 1

    def __post_init__(self) -> None:
        if self.nli_bf16 not in ("off", "on", "auto"):
            raise ExportError(f"nli_bf16 must be off, on or auto, got {self.nli_bf16!r}")
        if self.nli_init not in ("base", "reranker") or self.rerank_init not in ("base", "nli"):
            raise ExportError(f"nli_init must be base or reranker and rerank_init base or nli, "
                              f"got {self.nli_init!r} / {self.rerank_init!r}")
        from d2r_edge_export.fever_train import TITLE_MODES

        if (self.nli_fever_titles not in TITLE_MODES or self.nli_fever_train_pairs < 0
                or self.nli_fever_max_sentences < 1):
            raise ExportError(f"nli_fever_titles must be one of {', '.join(TITLE_MODES)} (got "
                              f"{self.nli_fever_titles!r}), nli_fever_train_pairs >= 0 and "
                              f"nli_fever_max_sentences >= 1")
        from d2r_edge_export.finetune_data import QA_FILES

        bad = [f for f in self.exclude_files if f not in QA_FILES]
        if bad:
            raise ExportError(f"--finetune-exclude: {', '.join(bad)} is not a QA file; choose among "
                              f"{', '.join(QA_FILES)} (FEVER dev holds the NLI's held-out validation)")
        if self.nli_init == "reranker" and self.rerank_init == "nli":
            raise ExportError("nli_init=reranker and rerank_init=nli start each role from the other; "
                              "set one of them to base")

    def init_role(self, role: str) -> str | None:
        """The role whose fine-tuned checkpoint starts `role`, None for the base model.

        The NLI chain: [reranker ->] nli_general -> nli when the general stage is on.
        """
        if role == "reader":
            return None
        if role == "nli" and self.nli_general_epochs > 0:
            return "nli_general"
        init = self.nli_init if role in ("nli", "nli_general") else self.rerank_init
        return None if init == "base" else init

    def fever_train(self) -> FeverTrainSpec:
        return FeverTrainSpec(self.nli_fever_train_pairs, self.nli_fever_titles, self.nli_fever_max_sentences)

    def general_sources(self) -> str | None:
        return self.nli_general_sources if self.nli_general_epochs > 0 else None

    def for_role(self, role: str) -> dict:
        """The settings that shape `role`'s training (its cache key)."""
        if role == "reader":        # its own settings and the shared ones (the NLI's and reranker's aside)
            out = {k: v for k, v in asdict(self).items()
                   if not k.startswith(("nli_", "rerank_")) and k not in ("batch_size", "max_length_tokens")}
            if not self.reader_cloze_examples:      # absent: readers cached before the cloze stage stay valid
                out = {k: v for k, v in out.items() if not k.startswith("reader_cloze_")}
            return out
        nli = role in ("nli", "nli_general")
        out = {k: v for k, v in asdict(self).items()
               if not k.startswith("nli_" if not nli else "rerank_") and not k.startswith("reader_")}
        if not self.exclude_files:           # absent, not empty: the checkpoints cached before it stay valid
            out.pop("exclude_files")
        if not nli:
            out.pop("batch_size")            # NLI pairs per step
            return out
        if role == "nli_general":            # what the FEVER/QA stage does is not its business
            # (the left-out QA questions reach it only through its pairs, which its key hashes)
            out = {k: v for k, v in out.items() if k not in ("nli_epochs", "nli_learning_rate", "nli_augment",
                                                             "exclude_files")
                   and not k.startswith("nli_fever_")}
        return {**out, "nli_bf16_used": self.use_bf16()}

    def use_bf16(self) -> bool:
        if self.nli_bf16 != "auto":
            return self.nli_bf16 == "on"
        try:
            flags = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            return False
        return "avx512_bf16" in flags or "amx_bf16" in flags


def _nli_rows(role: str, sets: PairSets) -> list[tuple[str, str, int]]:
    if role == "nli_general":
        if sets.general is None:
            raise ExportError("the general NLI stage has no pairs: build_pairs was called without general_sources")
        return sets.general.train
    return sets.nli_train


# `finetune = "NAME"` in a profile of models/profiles.toml picks one of these; CLI flags override.
FINETUNE_PRESETS = {
    "full": FinetuneSettings(),
    # the demo's NLI on a fresh machine: no reranker to start from (the profile has none), 16,000
    # general pairs and one FEVER/QA epoch; its held-out figures go into its manifest like any build
    # (FEVER pairs: 10,000 from FEVER train, as in the full build: FEVER dev trains nothing since issue 50)
    "quick": FinetuneSettings(nli_init="base", nli_epochs=1, max_train_pairs=16000),
}


def pairs_sha256(role: str, sets: PairSets) -> str:
    """The exact training data of `role`: a change in how pairs are built retrains."""
    rows = (_nli_rows(role, sets) if role.startswith("nli")
            else [[g.query, g.positives, g.negatives] for g in sets.rerank_train])
    return hashlib.sha256(json.dumps(rows, ensure_ascii=False).encode()).hexdigest()


def _key(role: str, base_sha256: str, sets: PairSets, s: FinetuneSettings, init_key: str | None) -> str:
    files, split = sets.files_sha256, sets.split
    if role != "nli":
        if role == "nli_general":   # FEVER train shapes the nli role's pairs and the reranker's FEVER queries
            files = {k: v for k, v in files.items() if k != FEVER_TRAIN_FILE}
        own = ("rule", "validation_percent") + (("rerank_train_groups", "rerank_val_questions")
                                                if role == "reranker" else ())
        split = {k: split[k] for k in own if k in split}
    h = hashlib.sha256()
    h.update(json.dumps({"role": role, "settings": s.for_role(role), "files": files,
                         "split": split, "pairs": pairs_sha256(role, sets), "init": init_key,
                         **({"general": sets.general.stats} if role == "nli_general" and sets.general else {})},
                        sort_keys=True).encode())
    h.update(bytes.fromhex(base_sha256))
    return h.hexdigest()


def _batches(lengths: list[int], batch: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Length-bucketed batches in a random order: little padding, still shuffled."""
    order = rng.permutation(len(lengths))
    out = []
    for start in range(0, len(order), batch * 50):
        block = order[start:start + batch * 50]
        block = block[np.argsort([lengths[i] for i in block], kind="stable")]
        out += [block[i:i + batch] for i in range(0, len(block), batch)]
    return [out[i] for i in rng.permutation(len(out))]


class _Loop:
    """AdamW + linear warmup/decay + clipping, logging every 50 steps."""

    def __init__(self, role: str, model, steps: int, lr: float, s: FinetuneSettings, bf16: bool = False) -> None:
        import torch
        from transformers import get_linear_schedule_with_warmup

        self.role, self.model, self.steps, self.bf16 = role, model, steps, bf16
        self.opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
        self.sched = get_linear_schedule_with_warmup(self.opt, int(steps * s.warmup_fraction), steps)
        self.losses: list[float] = []
        self.t0 = time.perf_counter()
        model.train()

    def logits(self, batch):
        import torch

        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16):
            return self.model(**batch).logits.float()

    def step(self, loss) -> None:
        import torch

        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad()
        self.losses.append(float(loss.detach()))
        if len(self.losses) % 50 == 0:
            log.info("%s: step %d/%d, loss %.3f, %.0f s", self.role, len(self.losses), self.steps,
                     float(np.mean(self.losses[-50:])), time.perf_counter() - self.t0)

    def stats(self) -> dict:
        self.model.eval()
        return {"steps": self.steps, "train_seconds": round(time.perf_counter() - self.t0, 1), "bf16": self.bf16,
                "final_loss_mean_last_50": float(np.mean(self.losses[-50:])) if self.losses else None}


def _model(init: Path, id2label: dict[int, str]):
    """A classifier with a new head over `init`'s encoder (the base MiniLM or the other role's)."""
    from transformers import AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()        # "newly initialized: classifier" is the point here
    try:
        return AutoModelForSequenceClassification.from_pretrained(
            str(init), num_labels=len(id2label), id2label=id2label,
            label2id={v: k for k, v in id2label.items()}, ignore_mismatched_sizes=True)
    finally:
        hf_logging.set_verbosity(level)


def _train_nli(tok, init: Path, sets: PairSets, s: FinetuneSettings, rng: np.random.Generator,
               role: str = "nli"):
    """Cross-entropy over (premise, hypothesis) pairs; from nli_general the 3-way head carries over."""
    import torch

    model = _model(init, ID2LABEL)
    rows = _nli_rows(role, sets)
    epochs, lr = ((s.nli_general_epochs, s.nli_general_learning_rate) if role == "nli_general"
                  else (s.nli_epochs, s.nli_learning_rate))
    # cut the passage, keep the claim/question
    enc = tok([p for p, _, _ in rows], [h for _, h, _ in rows], truncation="only_first",
              max_length=s.max_length_tokens)
    labels = torch.tensor([lab for _, _, lab in rows])
    lengths = [len(x) for x in enc["input_ids"]]
    loop = _Loop(role, model, epochs * ((len(rows) + s.batch_size - 1) // s.batch_size),
                 lr, s, bf16=s.use_bf16())
    loss_fn = torch.nn.CrossEntropyLoss()
    for _ in range(epochs):
        for idx in _batches(lengths, s.batch_size, rng):
            batch = tok.pad({k: [enc[k][i] for i in idx] for k in enc}, return_tensors="pt")
            loop.step(loss_fn(loop.logits(batch), labels[torch.as_tensor(idx)]))
    return model, {**loop.stats(), "train_pairs": len(rows)}


def _train_reranker(tok, init: Path, sets: PairSets, s: FinetuneSettings, rng: np.random.Generator):
    """Listwise: each relevant passage against the query's sampled irrelevant ones (softmax CE).

    Ranking is all the runtime asks of the reranker (top-n of the retrieved
    chunks), and every query's paragraphs come as a set, so the loss compares
    passages of one query instead of scoring pairs in isolation.
    """
    import torch

    model = _model(init, {0: "relevance"})
    groups = sets.rerank_train
    q = s.rerank_queries_per_batch
    loop = _Loop("reranker", model, s.rerank_epochs * ((len(groups) + q - 1) // q), s.rerank_learning_rate, s)
    for _ in range(s.rerank_epochs):
        order = rng.permutation(len(groups))
        for start in range(0, len(order), q):
            queries, passages, spans = [], [], []
            for gi in order[start:start + q]:
                g = groups[gi]
                negs = [g.negatives[i] for i in rng.permutation(len(g.negatives))[:s.rerank_negatives]]
                spans.append((len(passages), len(g.positives), len(negs)))
                queries += [g.query] * (len(g.positives) + len(negs))
                passages += list(g.positives) + negs
            batch = tok(queries, passages, truncation="only_second", max_length=s.max_length_tokens,
                        padding=True, return_tensors="pt")
            scores = loop.logits(batch)[:, 0]
            loss = 0.0
            for o, npos, nneg in spans:
                pos, neg = scores[o:o + npos], scores[o + npos:o + npos + nneg]
                table = torch.cat([pos[:, None], neg[None, :].expand(npos, nneg)], dim=1)
                loss = loss + torch.nn.functional.cross_entropy(table, torch.zeros(npos, dtype=torch.long))
            loop.step(loss / len(spans))
    return model, {**loop.stats(), "train_queries": len(groups)}


def span_labels(enc, examples) -> tuple[list[int], list[int], int]:
    """Start/end token of each example's answer in its encoded (question, passage) pair; [CLS] (0, 0)
    for a no-answer example and for one whose answer the truncation cut off (counted)."""
    starts, ends, cut = [], [], 0
    for i, ex in enumerate(examples):
        s_tok = e_tok = 0
        if ex.answer_start is not None:
            a0, a1 = ex.answer_start, ex.answer_start + len(ex.answer)
            seq, offsets = enc.sequence_ids(i), enc["offset_mapping"][i]
            inside = [t for t, (b, e) in enumerate(offsets) if seq[t] == 1 and b < a1 and e > a0]
            if inside:
                s_tok, e_tok = inside[0], inside[-1]
            else:
                cut += 1
        starts.append(s_tok)
        ends.append(e_tok)
    return starts, ends, cut


def _train_reader(tok, init: Path, sets, s: FinetuneSettings, rng: np.random.Generator):
    """Cross-entropy over the answer's start and end token (SQuAD 2.0-style: no answer = [CLS])."""
    import torch
    from transformers import AutoModelForQuestionAnswering
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()        # "newly initialized: qa_outputs" is the point here
    try:
        model = AutoModelForQuestionAnswering.from_pretrained(str(init))
    finally:
        hf_logging.set_verbosity(level)
    loss_fn = torch.nn.CrossEntropyLoss()

    def stage(name: str, ex: list, epochs: int) -> dict:
        # cut the passage, keep the question
        enc = tok([e.question for e in ex], [e.passage for e in ex], truncation="only_second",
                  max_length=s.reader_max_length_tokens, return_offsets_mapping=True)
        starts, ends, cut = span_labels(enc, ex)
        starts, ends = torch.tensor(starts), torch.tensor(ends)
        feats = {k: enc[k] for k in enc if k != "offset_mapping"}
        lengths = [len(x) for x in enc["input_ids"]]
        loop = _Loop(name, model, epochs * ((len(ex) + s.reader_batch_size - 1) // s.reader_batch_size),
                     s.reader_learning_rate, s)
        for _ in range(epochs):
            for idx in _batches(lengths, s.reader_batch_size, rng):
                batch = tok.pad({k: [feats[k][i] for i in idx] for k in feats}, return_tensors="pt")
                out = model(**batch)
                sel = torch.as_tensor(idx)
                loop.step((loss_fn(out.start_logits, starts[sel]) + loss_fn(out.end_logits, ends[sel])) / 2)
        return {**loop.stats(), "train_examples": len(ex), "answers_cut_by_truncation": cut}

    first = stage("reader-cloze", sets.pretrain, s.reader_cloze_epochs) if sets.pretrain else None
    out = {**stage("reader", sets.train, s.reader_epochs), "data": sets.stats}
    if first is not None:
        out["cloze_stage"] = first
    return model, out


def train(role: str, init: Path, sets, out: Path, s: FinetuneSettings) -> dict:
    """Fine-tune `role` from the checkpoint `init` (MiniLM or the other role's) into `out`."""
    import torch
    from transformers import AutoTokenizer

    torch.manual_seed(s.seed)
    rng = np.random.default_rng(s.seed)
    tok = AutoTokenizer.from_pretrained(str(init))
    if role == "reader":
        model, stats = _train_reader(tok, init, sets, s, rng)
    elif role.startswith("nli"):
        model, stats = _train_nli(tok, init, sets, s, rng, role)
    else:
        model, stats = _train_reranker(tok, init, sets, s, rng)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    for name in TOKENIZER_FILES:
        if (init / name).is_file():
            shutil.copyfile(init / name, out / name)
    # serve at the length it was trained at: the export reads max_seq_length from here
    # (the reranker trained at 128 lost 3 points of recall@3 when scored at 256)
    (out / "sentence_bert_config.json").write_text(json.dumps(
        {"max_seq_length": s.reader_max_length_tokens if role == "reader" else s.max_length_tokens}))
    return stats


def finetuned_checkpoint(role: str, base: Path, data_dir: Path, cache_dir: Path,
                         s: FinetuneSettings) -> tuple[Path, dict]:
    """The fine-tuned checkpoint for `role`, trained once per data/settings hash."""
    missing = missing_files(data_dir)
    if missing:
        raise ExportError(f"fine-tuning needs the labeled samples {', '.join(missing)} under {data_dir}; "
                          f"pass --data-dir pointing at the shared data folder")
    if role == "reader":
        from d2r_edge_export.reader_data import build_reader_sets

        sets = build_reader_sets(data_dir, s.exclude_files, s.seed, s.reader_negatives)
        if s.max_train_pairs:       # a quick build's cut, as for the NLI's pairs
            sets.train = sets.train[:s.max_train_pairs]
        if s.reader_cloze_examples:
            from d2r_edge_export.reader_cloze import cloze_for_reader

            cloze_for_reader(sets, data_dir, s.reader_cloze_examples, s.seed, s.reader_negatives)
        return _reader_checkpoint(base, sha256_file(base / "model.safetensors"), sets, cache_dir, s)
    sets = build_pairs(data_dir, s.max_train_pairs, s.seed, s.rerank_fever_groups, s.nli_augment,
                       s.general_sources() if role == "nli" else None,
                       s.fever_train() if role == "nli" else FeverTrainSpec(), s.exclude_files)
    return _checkpoint(role, base, sha256_file(base / "model.safetensors"), sets, cache_dir, s)


def _checkpoint(role: str, base: Path, base_sha256: str, sets: PairSets, cache_dir: Path,
                s: FinetuneSettings) -> tuple[Path, dict]:
    """`role`'s checkpoint, after the one it starts from (same pairs and base hash for both)."""
    init_role = s.init_role(role)
    init, init_meta = ((base, None) if init_role is None
                       else _checkpoint(init_role, base, base_sha256, sets, cache_dir, s))
    key = _key(role, base_sha256, sets, s, init_meta["cache_key"] if init_meta else None)

    def build(tmp: Path) -> dict:
        log.info("fine-tuning %s from %s on %s", role, init_role or "the base model", sets.split)
        stats = train(role, init, sets, tmp, s)
        return {"base_model_sha256": base_sha256,
                "base_model": str(base), "data_files_sha256": sets.files_sha256, "split": sets.split,
                "settings": s.for_role(role), "training_pairs_sha256": pairs_sha256(role, sets),
                "initialized_from": ({"role": init_role, "cache_key": init_meta["cache_key"]} if init_meta
                                     else "base_model"),
                **({"general_data": sets.general.stats} if role == "nli_general" and sets.general else {}),
                **({"fever_train_data": sets.fever_train} if role == "nli" and sets.fever_train else {}),
                **({"first_stage": init_meta} if init_role == "nli_general" else {}),
                "cache_key": key, **stats}
    return _cached(role, key, cache_dir, build)


def _cached(role: str, key: str, cache_dir: Path, build) -> tuple[Path, dict]:
    """cache_dir/finetune/<role>-<key>: reused when finished, else `build(tmp)` -> its training.json."""
    out = cache_dir / "finetune" / f"{role}-{key[:16]}"
    meta_path = out / "training.json"
    if meta_path.is_file():
        log.info("reusing fine-tuned %s from %s", role, out)
        return out, json.loads(meta_path.read_text())
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    meta = build(tmp)
    (tmp / "training.json").write_text(json.dumps(meta, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out, meta


def _reader_checkpoint(base: Path, base_sha256: str, sets, cache_dir: Path, s: FinetuneSettings) -> tuple[Path, dict]:
    """The reader's checkpoint, trained once per span examples / settings / base weights."""
    h = hashlib.sha256()
    h.update(json.dumps({"role": "reader", "settings": s.for_role("reader"), "files": sets.files_sha256,
                         "examples": sets.train_sha256()}, sort_keys=True).encode())
    h.update(bytes.fromhex(base_sha256))
    key = h.hexdigest()

    def build(tmp: Path) -> dict:
        log.info("fine-tuning reader from the base model on %s", json.dumps(sets.stats))
        stats = train("reader", base, sets, tmp, s)
        return {"base_model_sha256": base_sha256, "base_model": str(base), "data_files_sha256": sets.files_sha256,
                "split": sets.split(),
                "settings": s.for_role("reader"), "training_examples_sha256": sets.train_sha256(),
                "initialized_from": "base_model", "cache_key": key, **stats}
    return _cached("reader", key, cache_dir, build)

