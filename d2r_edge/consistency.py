"""Self-consistency: does the generator give the same answer when asked again?

SelfCheckGPT (Manakul et al., 2023) and semantic entropy (Farquhar et al.,
Nature 2024): a model that knows the answer repeats it across samples drawn at
a temperature above 0; one that guesses scatters. Here the generator's greedy
answer is compared with N sampled answers to the same prompt
(`OpenAICompatible(samples=N)`, `--self-consistency N`):

- answers are clustered first by their normalized string (FEVER: the label;
  QA: SQuAD normalization, the EM one); for QA, two string-clusters then merge
  when the NLI says each answer entails the other in the question's context
  ("Q A1" <-> "Q A2", Farquhar et al.'s bidirectional entailment), so "JFK" and
  "John F. Kennedy" count as one meaning;
- signals: `sc_agreement`, the share of the samples in the greedy answer's
  cluster; `sc_clusters`, the number of clusters among greedy + samples;
  `sc_entropy`, the entropy (nats) of the cluster distribution over greedy +
  samples.

A generator without samples (the extractive one, N = 0, a cached answer from
before) leaves the signals missing (None), never invented.

`majority` is the same clustering used as an answer: the repair arm
`sample_majority` (d2r_edge.repair) answers with the largest cluster's answer,
for free once the first attempt's samples exist (Wang et al., 2023, "self-
consistency improves chain of thought reasoning": the majority of sampled
answers beats the greedy one).
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Protocol

import numpy as np

from d2r_edge.answers import fever_label, normalize_answer

SIGNALS = ("sc_agreement", "sc_clusters", "sc_entropy")


class PairScorer(Protocol):
    labels: list                              # the NLI's class names ("entailment", ...)

    def score(self, pairs: list[tuple[str, str]]) -> np.ndarray:
        """Class probabilities per (premise, hypothesis) pair."""
        ...


def answer_key(answer: str, fact_verification: bool) -> str:
    """Answers equal under this key are the same answer (FEVER: the label; QA: SQuAD normalization)."""
    return fever_label(answer) if fact_verification else normalize_answer(answer)


def clusters(query: str, answers: list[str], fact_verification: bool, nli: PairScorer | None = None) -> list[int]:
    """A cluster id per answer: equal normalized strings share one; for QA with an NLI, string-clusters
    whose representatives entail each other (both ways, in the question's context) merge."""
    keys = [answer_key(a, fact_verification) for a in answers]
    reps = list(dict.fromkeys(keys))          # one representative per string-cluster, in order
    parent = list(range(len(reps)))
    if nli is not None and not fact_verification and len(reps) > 1:
        ent = [i for i, lab in enumerate(nli.labels) if str(getattr(lab, "value", lab)).lower() == "entailment"]
        if ent:
            pairs = [(i, j) for i in range(len(reps)) for j in range(len(reps)) if i != j]
            texts = {i: f"{query} {answers[keys.index(r)]}" for i, r in enumerate(reps)}
            probs = nli.score([(texts[i], texts[j]) for i, j in pairs])
            entails = {pair: int(np.argmax(p)) == ent[0] for pair, p in zip(pairs, probs)}

            def find(i: int) -> int:
                while parent[i] != i:
                    i = parent[i]
                return i

            for i, j in pairs:
                if i < j and entails[(i, j)] and entails[(j, i)]:
                    parent[find(j)] = find(i)
            parent = [find(i) for i in range(len(reps))]
    return [parent[reps.index(k)] for k in keys]


def signals(query: str, greedy: str, samples: tuple[str, ...] | list[str] | None, fact_verification: bool,
            nli: PairScorer | None = None) -> dict[str, float] | None:
    """The three signals of the module docstring; None without samples."""
    if not samples:
        return None
    ids = clusters(query, [greedy, *samples], fact_verification, nli)
    counts = Counter(ids)
    n = len(ids)
    return {"sc_agreement": sum(1 for c in ids[1:] if c == ids[0]) / (n - 1),
            "sc_clusters": float(len(counts)),
            "sc_entropy": float(-sum(c / n * math.log(c / n) for c in counts.values()))}


def majority(query: str, greedy: str, samples: tuple[str, ...] | list[str], fact_verification: bool,
             nli: PairScorer | None = None) -> str:
    """The answer of the largest cluster among greedy + samples (clustered as `clusters` does); a tie
    goes to the greedy answer's cluster if it is among the largest, else to the one seen first. The
    cluster's answer is its first member's: the greedy answer when it is in it."""
    answers = [greedy, *samples]
    ids = clusters(query, answers, fact_verification, nli)
    counts = Counter(ids)
    best = max(counts.values())
    winner = ids[0] if counts[ids[0]] == best else next(c for c in ids if counts[c] == best)
    return answers[ids.index(winner)]
