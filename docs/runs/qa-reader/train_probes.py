"""Issue 53's training-side probes on HotpotQA's 202 training questions (the first 101 of each file), read from
qa-selfcheck's stored first attempts: which further signals carry anything before they go into the detector.

    python docs/runs/qa-reader/train_probes.py $WORK/qa-selfcheck ../shared/data [--self-check CACHE.jsonl]

1. answer type vs question type (yes/no, date, number, person) and where the answer sits in the passages;
2. with --self-check: P(True) asked plainly vs with the four self-consistency samples shown (Kadavath et al.
   2022 sec. 3.3), through the evaluation's cached generator (llama-server on 127.0.0.1:8080), so that the
   evaluation replays the same requests. Prints AUROC for "the first answer is wrong" (EM < 1)."""

import json
import re
import sys
from pathlib import Path

import numpy as np

from d2r_edge.answers import normalize_answer
from d2r_edge.eval.detection import auroc
from d2r_edge.eval.metrics import exact_match

run, shared = Path(sys.argv[1]), Path(sys.argv[2])
rows = {r["query"]: r for r in map(json.loads, (run / "attempts.jsonl").open())}
chunks = {c["chunk_id"]: c for c in map(json.loads, (run / "kb" / "chunks.jsonl").open())}
train = [q for f in ("hotpotqa/dev.jsonl", "hotpotqa_fullwiki/dev.jsonl")
         for q in list(map(json.loads, (shared / f).open()))[:101]]
YESNO = re.compile(r"^(is|are|was|were|do|does|did|can|could|has|have|had|will|would|should)\b", re.I)
MONTH = re.compile(r"\b(january|february|march|april|may|june|july|august|september|october|november|december)\b",
                   re.I)


def qtype(q: str) -> str:
    ql = q.lower().strip()
    if YESNO.match(ql):
        return "yesno"
    if re.match(r"^(when|what year|in what year|which year|in which year|what date)\b", ql):
        return "date"
    if re.match(r"^how (many|much|long|old|tall|far|large|big)\b", ql):
        return "number"
    return "person" if re.match(r"^(who|whom|whose)\b", ql) else "other"


def type_mismatch(t: str, a: str) -> float:
    yn = a.strip().lower() in ("yes", "no")
    if t == "yesno":
        return float(not yn)
    if yn:
        return 1.0
    if t == "date":
        return float(not (re.search(r"\d", a) or MONTH.search(a)))
    if t == "number":
        return float(not re.search(r"\d|\b(one|two|three|four|five|six|seven|eight|nine|ten)\b", a.lower()))
    if t == "person":
        return float(not (a[:1].isupper() and not re.search(r"\d", a)))
    return 0.5                       # no expectation


def texts_of(r: dict) -> list[str]:
    return [f"{chunks[c]['title']}\n{chunks[c]['text']}" if chunks[c]["title"] else chunks[c]["text"]
            for c, _ in r["attempt"]["passages"]]


wrong, mismatch, rank = [], [], []
for q in train:
    r = rows[q["question"]]
    a = r["attempt"]["generation"]["response"] or ""
    needle = normalize_answer(a)
    hits = [bool(needle) and f" {needle} " in f" {normalize_answer(t.replace(chr(10), ' '))} " for t in texts_of(r)]
    wrong.append(exact_match(a, [q["answer"]]) < 1)
    mismatch.append(type_mismatch(qtype(q["question"]), a))
    rank.append(hits.index(True) if any(hits) else len(hits))
wrong, mismatch, rank = np.array(wrong), np.array(mismatch), np.array(rank, dtype=float)
found = rank < 5
print(f"{len(wrong)} training questions, {int(wrong.sum())} first answers wrong")
print(f"answer type vs question type, AUROC {auroc(mismatch, wrong):.3f} "
      f"({sum(qtype(q['question']) == 'yesno' for q in train)} yes/no questions)")
print(f"answer found in a passage at all, AUROC {auroc((~found).astype(float), wrong):.3f}; among the {found.sum()} "
      f"found, the first passage's rank, AUROC {auroc(rank[found], wrong[found]):.3f}")
if "--self-check" in sys.argv:
    from d2r_edge.eval.outcomes import CachedGenerator
    from d2r_edge.generate.openai_compat import OpenAICompatible
    from d2r_edge.tasks import Task

    inner = OpenAICompatible("http://127.0.0.1:8080/v1", "qwen2.5-coder-0.5b-instruct", timeout_s=120, samples=4,
                             sample_temperature=0.7, self_check=True, self_check_samples=True)
    cache = CachedGenerator(inner, Path(sys.argv[sys.argv.index("--self-check") + 1]))
    plain, shown = [], []
    for q in train:
        g = rows[q["question"]]["attempt"]["generation"]
        plain.append(cache.p_true(Task.QA, q["question"], texts_of(rows[q["question"]]), g["response"])[0])
        shown.append(cache.p_true(Task.QA, q["question"], texts_of(rows[q["question"]]), g["response"],
                                  tuple(g["samples"]))[0])
    cache.close()
    p0, p1 = (np.array([np.nan if v is None else v for v in x]) for x in (plain, shown))
    ok = ~np.isnan(p0) & ~np.isnan(p1)
    print(f"P(True), AUROC of 1 - P(True) on {ok.sum()}: plain {auroc(1 - p0[ok], wrong[ok]):.3f}, "
          f"samples shown {auroc(1 - p1[ok], wrong[ok]):.3f} ({cache.calls} requests, {cache.hits} from the cache)")
