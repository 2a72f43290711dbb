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

from d2r_edge.errors import ExportError
from export.finetune_data import ID2LABEL, PairSets, build_pairs

log = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")


@dataclass(frozen=True)
class FinetuneSettings:
    epochs: int = 2
    learning_rate: float = 5e-5
    batch_size: int = 32
    # 128 tokens and at most 6000 reranker pairs keep the whole offline build
    # under 25 minutes on 2 CPU cores (measured ~1.5 s per step of 32 at 192).
    max_length_tokens: int = 128
    warmup_fraction: float = 0.1
    seed: int = 0
    max_train_pairs: int | None = None
    max_rerank_pairs: int = 6000


def _key(role: str, base: Path, sets: PairSets, s: FinetuneSettings) -> str:
    h = hashlib.sha256()
    h.update(json.dumps({"role": role, "settings": asdict(s), "files": sets.files_sha256,
                         "split": sets.split}, sort_keys=True).encode())
    h.update(hashlib.sha256((base / "model.safetensors").read_bytes()).digest())
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


def train(role: str, base: Path, sets: PairSets, out: Path, s: FinetuneSettings) -> dict:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_linear_schedule_with_warmup

    torch.manual_seed(s.seed)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    rng = np.random.default_rng(s.seed)
    tok = AutoTokenizer.from_pretrained(str(base))
    if role == "nli":
        pairs = [(p, h) for p, h, _ in sets.nli_train]
        labels = torch.tensor([lab for _, _, lab in sets.nli_train])
        model = AutoModelForSequenceClassification.from_pretrained(
            str(base), num_labels=3, id2label=ID2LABEL, label2id={v: k for k, v in ID2LABEL.items()})
        truncation = "only_first"          # cut the passage, keep the claim/question
    else:
        rows = sets.rerank_train[: s.max_rerank_pairs]
        pairs = [(q, p) for q, p, _ in rows]
        labels = torch.tensor([y for _, _, y in rows], dtype=torch.float32)
        model = AutoModelForSequenceClassification.from_pretrained(
            str(base), num_labels=1, id2label={0: "relevance"}, label2id={"relevance": 0})
        truncation = "only_second"         # cut the passage, keep the query
    enc = tok([a for a, _ in pairs], [b for _, b in pairs], truncation=truncation,
              max_length=s.max_length_tokens)
    lengths = [len(x) for x in enc["input_ids"]]
    steps = s.epochs * ((len(pairs) + s.batch_size - 1) // s.batch_size)
    opt = torch.optim.AdamW(model.parameters(), lr=s.learning_rate, weight_decay=0.01)
    sched = get_linear_schedule_with_warmup(opt, int(steps * s.warmup_fraction), steps)
    loss_fn = torch.nn.CrossEntropyLoss() if role == "nli" else torch.nn.BCEWithLogitsLoss()
    model.train()
    t0, done, losses = time.perf_counter(), 0, []
    for epoch in range(s.epochs):
        for idx in _batches(lengths, s.batch_size, rng):
            batch = tok.pad({k: [enc[k][i] for i in idx] for k in enc}, return_tensors="pt")
            logits = model(**batch).logits
            y = labels[torch.as_tensor(idx)]
            loss = loss_fn(logits, y) if role == "nli" else loss_fn(logits[:, 0], y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad()
            done += 1
            losses.append(float(loss))
            if done % 50 == 0:
                log.info("%s: step %d/%d, loss %.3f, %.0f s", role, done, steps,
                         float(np.mean(losses[-50:])), time.perf_counter() - t0)
    model.eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    for name in TOKENIZER_FILES:
        if (base / name).is_file():
            shutil.copyfile(base / name, out / name)
    if (base / "sentence_bert_config.json").is_file():
        shutil.copyfile(base / "sentence_bert_config.json", out / "sentence_bert_config.json")
    return {"steps": steps, "train_pairs": len(pairs), "train_seconds": round(time.perf_counter() - t0, 1),
            "final_loss_mean_last_50": float(np.mean(losses[-50:])) if losses else None}


def finetuned_checkpoint(role: str, base: Path, data_dir: Path, cache_dir: Path,
                         s: FinetuneSettings) -> tuple[Path, dict]:
    """The fine-tuned checkpoint for `role`, trained once per data/settings hash."""
    if not (data_dir / "fever" / "dev.jsonl").is_file():
        raise ExportError(f"fine-tuning needs the labeled data in {data_dir} (fever, hotpotqa, musique, "
                          f"2wikimultihopqa dev.jsonl); pass --data-dir")
    sets = build_pairs(data_dir, s.max_train_pairs, s.seed)
    key = _key(role, base, sets, s)
    out = cache_dir / "finetune" / f"{role}-{key[:16]}"
    meta_path = out / "training.json"
    if meta_path.is_file():
        log.info("reusing fine-tuned %s from %s", role, out)
        return out, json.loads(meta_path.read_text())
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    log.info("fine-tuning %s on %s", role, sets.split)
    stats = train(role, base, sets, tmp, s)
    meta = {"base_model_sha256": hashlib.sha256((base / "model.safetensors").read_bytes()).hexdigest(),
            "base_model": str(base), "data_files_sha256": sets.files_sha256, "split": sets.split,
            "settings": asdict(s), "cache_key": key, **stats}
    (tmp / "training.json").write_text(json.dumps(meta, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out, meta
