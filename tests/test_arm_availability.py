"""Issue 26: an arm that needs a model the profile lacks is off everywhere (run, train, eval answers)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from stand_ins import HashNLI, fever_world, hash_nli_scores, profile_without

from d2r_edge.onnx.manifest import Role
from d2r_edge.repair import ARM_NAMES, arm_availability

RERANK = ARM_NAMES.index("rerank")
NO_RERANKER = {"reranker": "the quick build trains no reranker; rerank arms are off"}
# the extractive generator draws no self-consistency samples: the voting arm is off in every profile here,
# and these are FEVER pipelines: the reader's arm answers questions, not claims
NO_VOTE = arm_availability(list(Role), fact_verification=True).unavailable
assert list(NO_VOTE) == ["sample_majority", "reader_span"]


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_models, shared_data):
    tmp = tmp_path_factory.mktemp("arms")
    kb, queries = fever_world(tmp, tiny_models, shared_data, n_docs=120, n_queries=24)
    return {"kb": kb, "queries": queries,
            "no_reranker": profile_without(tiny_models, tmp / "no-reranker", NO_RERANKER),
            "no_triples": profile_without(tiny_models, tmp / "no-triples", {"triples": "no REBEL offline"})}


def _pipeline(world, models: Path, **kw):
    from d2r_edge.app import RunSettings, build_pipeline
    from d2r_edge.tasks import Task

    kw.setdefault("policy_kind", "linucb")        # a LinUCB's file is read below (FEVER's default: the fixed arm)
    p = build_pipeline(RunSettings(kb=world["kb"], models=models, task=Task.FEVER, allow_random_weights=True, **kw))
    p.diagnoser.nli = HashNLI(p.diagnoser.nli)
    return p


def _rerank_loving_policy(world, tiny_models, path: Path) -> Path:
    """A LinUCB whose every arm has seen many contexts, rerank always rewarded, the rest never."""
    from d2r_edge.policy import LinUCB

    context = _pipeline(world, tiny_models).context
    dim = context.dim
    pol = LinUCB(len(ARM_NAMES), dim, 0.1, arm_names=ARM_NAMES)
    pol.context = context.spec
    rng = np.random.default_rng(0)
    for _ in range(40):
        x = rng.normal(size=dim)
        x[-1] = 1.0
        for arm in range(len(ARM_NAMES)):
            pol.update(arm, x, 1.0 if arm == RERANK else 0.0)
    pol.save(path)
    return path


def test_the_one_place_that_decides_names_the_missing_role():
    from d2r_edge.repair import allowed_arms

    every = arm_availability(list(Role), samples=4)
    assert every.mask.all() and every.unavailable == {}
    quick = arm_availability([Role.NLI, Role.EMBEDDER, Role.READER], {Role.RERANKER: "the quick build trains none"},
                             samples=4)
    assert quick.mask.tolist() == [name != "rerank" for name in ARM_NAMES]
    assert quick.unavailable == {"rerank": "no reranker model (the quick build trains none)"}
    # the reader's arm: off without a reader, and for FEVER's claims whatever the profile
    assert arm_availability([Role.NLI, Role.EMBEDDER], samples=4).unavailable["reader_span"].startswith("no reader")
    assert "claim" in arm_availability(list(Role), samples=4, fact_verification=True).unavailable["reader_span"]
    # without self-consistency samples the voting arm is off too, and says how to turn it on
    plain = arm_availability(list(Role))
    assert plain.mask.tolist() == [name != "sample_majority" for name in ARM_NAMES]
    assert "--self-consistency N with N >= 2" in plain.unavailable["sample_majority"]
    assert "in the profile's manifest" in arm_availability([Role.NLI]).unavailable["rerank"]
    # masked like the UNVERIFIED rule, on top of it
    assert not allowed_arms(False, True, quick.mask)[RERANK]
    assert allowed_arms(True, True, quick.mask).tolist() == allowed_arms(True, True).tolist()
    with pytest.raises(ValueError, match="one entry per arm"):
        type(quick)(np.ones(3, dtype=bool))


def test_the_voting_arm_follows_the_generator_s_samples(world, tiny_models):
    vote = ARM_NAMES.index("sample_majority")
    assert not _pipeline(world, tiny_models).arms.mask[vote]               # extractive: nothing to vote on
    llm = dict(generator="openai", base_url="http://127.0.0.1:9/v1", model="m")
    assert not _pipeline(world, tiny_models, **llm).arms.mask[vote]
    assert _pipeline(world, tiny_models, **llm, self_consistency=3).arms.mask[vote]


def test_run_with_a_rerank_policy_never_picks_rerank_without_a_reranker(world, tiny_models, tmp_path):
    from d2r_edge.runner import load_queries, process, summary

    policy = _rerank_loving_policy(world, tiny_models, tmp_path / "policy.npz")
    queries = load_queries(world["queries"])
    # with the reranker loaded, this policy does pick rerank (so the test below can fail)
    full = process(_pipeline(world, tiny_models, policy_path=policy), queries, tmp_path / "full.jsonl",
                   learn=False).records
    assert any(r["repair"] and r["repair"]["arm"] == "rerank" for r in full)
    recs = process(_pipeline(world, world["no_reranker"], policy_path=policy), queries,
                   tmp_path / "quick.jsonl", learn=False).records
    assert all(r["error"] is None for r in recs)
    repaired = [r for r in recs if r["repair"]]
    assert repaired and all(r["repair"]["arm"] != "rerank" for r in repaired)
    for r in repaired:
        assert "rerank" not in r["repair"]["allowed"]
        assert r["repair"]["unavailable"] == {"rerank": f"no reranker model ({NO_RERANKER['reranker']})", **NO_VOTE}
    heading = "arms off (the loaded models cannot run them): "
    off = [line for line in summary(recs).splitlines() if line.startswith(heading)]
    assert len(off) == 1 and "; rerank (no reranker model" in off[0]


def test_train_without_a_reranker_never_tries_rerank(world, tmp_path):
    from d2r_edge.app import train
    from d2r_edge.policy import LinUCB
    from d2r_edge.runner import load_queries

    policy = tmp_path / "p.npz"
    p = _pipeline(world, world["no_reranker"], policy_path=policy, create_policy=True)
    records = train(p, load_queries(world["queries"])[:12], tmp_path / "train.jsonl", policy, epochs=2)
    assert len(records) == 24 and all(r["error"] is None for r in records)
    assert any(r["repair"] for r in records)
    assert all(r["repair"]["arm"] != "rerank" for r in records if r["repair"])
    saved = LinUCB.load(policy)
    assert saved.counts[RERANK] == 0 and saved.counts.sum() > 0    # the file keeps every arm


def test_a_profile_without_triples_runs_and_masks_nothing(world, tmp_path):
    from d2r_edge.runner import load_queries, process

    p = _pipeline(world, world["no_triples"])
    assert p.arms.unavailable == NO_VOTE and p.arms.mask.sum() == len(ARM_NAMES) - 2
    recs = process(p, load_queries(world["queries"])[:10], tmp_path / "r.jsonl", learn=False).records
    assert all(r["error"] is None for r in recs)
    assert {r["first"]["kg"] for r in recs} == {"no_triplets"}
    assert all(r["repair"]["unavailable"] == NO_VOTE for r in recs if r["repair"])


def test_eval_answers_every_method_without_a_reranker(world, tiny_models, tmp_path, shared_data, monkeypatch):
    """All methods complete; no method tries or chooses an unavailable arm; the report names them.
    `dense_k20` (and its refresh twin) is also taken away here (as if it needed a missing role), so the `expansion`
    baseline, whose arm it is, must say so instead of failing."""
    import d2r_edge.app as app
    from d2r_edge.cli import main
    from d2r_edge.onnx.encoders import NLI

    real_availability = app.arm_availability

    def without_k20(roles, absent=None, samples=0, fact_verification=False):
        a = real_availability(roles, absent, samples, fact_verification)
        mask, why = a.mask.copy(), dict(a.unavailable)
        for name in ("dense_k20", "dense_k20_refresh"):    # twins here: no refresh source in an eval
            mask[ARM_NAMES.index(name)] = False
            why[name] = "taken away by this test"
        return type(a)(mask, why)

    monkeypatch.setattr(app, "arm_availability", without_k20)
    monkeypatch.setattr(NLI, "score", lambda self, pairs: hash_nli_scores(pairs))
    fever = tmp_path / "fever.jsonl"
    fever.write_text("\n".join((shared_data / "fever" / "dev.jsonl").read_text().splitlines()[:200]) + "\n")
    out = tmp_path / "out"
    assert main(["eval", "answers", "--task", "fever", "--train", str(fever), "--test", str(fever),
                 "--train-limit", "10", "--test-limit", "20", "--models", str(world["no_reranker"]),
                 "--allow-random-weights", "--out", str(out), "--bootstrap", "200"]) == 0
    s = json.loads((out / "summary.json").read_text())
    off = {"rerank", "dense_k20", "dense_k20_refresh", *NO_VOTE}
    assert set(s["unavailable_arms"]) == off
    for m in s["methods"]:
        recs = [json.loads(x) for x in (out / "methods" / f"{m}.jsonl").read_text().splitlines()]
        assert len(recs) == 20 and not {r["arm"] for r in recs} & off, m
    assert s["methods"]["linucb"]["repaired_share"] > 0
    assert s["methods"]["expansion"]["repaired_share"] == 0
    assert s["methods"]["expansion"]["arm_unavailable"] == {"dense_k20": "taken away by this test"}
    assert not {a for cells in s["arms_by_failure"].values() for a in cells} & off
    configs = {json.loads(x)["config"] for x in (out / "attempts.jsonl").read_text().splitlines()}
    assert not any("rerank1" in c or c.startswith("dense|k20|") for c in configs), configs
    report = (out / "report.md").read_text()
    assert "`rerank` (no reranker model (the quick build trains no reranker" in report
    assert "`expansion` would apply `dense_k20`, which is unavailable" in report


def test_the_readme_profile_table_is_what_the_code_does():
    """README's 'arms off' column against `arm_availability` over each profile's roles."""
    import re
    import tomllib

    root = Path(__file__).resolve().parent.parent
    profiles = tomllib.loads((root / "models" / "profiles.toml").read_text())
    rows = {m.group(1): m.group(2).strip() for m in re.finditer(r"^\| `([\w-]+)` \|.*\| ([^|]+) \|$",
                                                               (root / "README.md").read_text(), re.M)}
    assert set(profiles) <= set(rows), set(profiles) - set(rows)
    for name, spec in profiles.items():
        roles = [Role(r) for r in Role if isinstance(spec.get(r.value), str)
                 and not spec[r.value].startswith("absent:")]
        off = sorted(arm_availability(roles, samples=4).unavailable)     # the models' (the vote is the generator's)
        assert rows[name] == (", ".join(f"`{a}`" for a in off) or "none"), name
