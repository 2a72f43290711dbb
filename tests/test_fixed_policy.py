"""The best fixed arm as a policy (issue 51: FEVER's default, chosen by the methods' training CV).

- select: the allowed arm with the best mean Eq. 2 reward among those tried (ties: the lower index; none
  tried: the first allowed); updates refine the chosen arm's mean; the file round-trips and a damaged
  one is refused;
- `train` is full-information with it: every allowed arm of a repaired query is tried and each updates
  the policy (the record lists them), and a crash replays exactly the updates the saved file lacks;
- the default kind: FEVER fixed, QA LinUCB, and an existing --policy file's own kind.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_loop import _pipeline, world  # noqa: F401  (the module-scoped KB and claims)

from d2r_edge.app import RunSettings, policy_kind, train
from d2r_edge.errors import PolicyError, PolicyFileError
from d2r_edge.policy import BestFixed, LinUCB, updates_of
from d2r_edge.runner import load_queries
from d2r_edge.tasks import Task


def test_select_takes_the_best_mean_among_allowed_and_tried_arms(tmp_path):
    p = BestFixed(4, arm_names=["a", "b", "c", "d"])
    assert p.select() == 0 and p.select(allowed=[2, 3]) == 2          # untrained: the first allowed
    for arm, r in ((1, 0.9), (1, 0.5), (2, 0.6), (3, 0.2)):
        p.update(arm, None, r)
    assert p.means()[1] == pytest.approx(0.7) and np.isnan(p.means()[0])
    assert p.select() == 1 and p.select(allowed=[0, 2, 3]) == 2 and p.select(allowed=[0]) == 0
    assert updates_of(p) == 4
    with pytest.raises(PolicyError):
        p.update(1, None, 1.5)                                          # Eq. 2 rewards are in [0, 1]
    p.save(tmp_path / "f.npz")
    back = BestFixed.load(tmp_path / "f.npz", arm_names=["a", "b", "c", "d"])
    assert np.array_equal(back.counts, p.counts) and np.allclose(back.sums, p.sums) and back.select() == 1
    with pytest.raises(PolicyFileError, match="4 arms"):
        BestFixed.load(tmp_path / "f.npz", arm_names=["a", "b", "c", "d", "e"])
    z = dict(np.load(tmp_path / "f.npz"))
    z["sums"] = z["sums"] + 5.0                                         # more reward than tries: damaged
    np.savez(tmp_path / "bad.npz", **z)
    with pytest.raises(PolicyFileError, match="damaged"):
        BestFixed.load(tmp_path / "bad.npz")
    with pytest.raises(PolicyFileError, match="holds a fixed policy, not linucb"):
        LinUCB.load(tmp_path / "f.npz")


def test_the_default_kind_is_the_tasks_or_the_files_own(tmp_path):
    fever = RunSettings(kb=tmp_path, models=tmp_path, task=Task.FEVER)
    qa = RunSettings(kb=tmp_path, models=tmp_path, task=Task.QA)
    assert (policy_kind(fever), policy_kind(qa)) == ("fixed", "thompson")
    LinUCB(3, 2, 1.0).save(tmp_path / "l.npz")
    trained = RunSettings(kb=tmp_path, models=tmp_path, task=Task.FEVER, policy_path=tmp_path / "l.npz")
    assert policy_kind(trained) == "linucb"                       # trained with the old default: still read
    asked = RunSettings(kb=tmp_path, models=tmp_path, task=Task.QA, policy_kind="fixed")
    assert policy_kind(asked) == "fixed"


def test_train_tries_every_allowed_arm_and_a_crash_replays_what_the_file_lacks(world, tiny_models,  # noqa: F811
                                                                              tmp_path):
    _, _, qpath = world
    queries = load_queries(qpath)[:12]
    policy = tmp_path / "fixed.npz"
    p = _pipeline(world, tiny_models, policy_path=policy, create_policy=True)
    assert isinstance(p.policy, BestFixed)                        # FEVER's default
    records = train(p, queries, tmp_path / "train.jsonl", policy, epochs=1)
    repaired = [r for r in records if r.get("repair")]
    assert repaired
    total = 0
    for r in repaired:
        rep = r["repair"]
        tried = [u["arm_index"] for u in rep["updates"]]
        offered = set(rep["allowed"]) - set(rep["cost_masked"])
        assert {p.policy.arm_names[i] for i in tried} == offered and len(tried) == len(offered)
        assert rep["arm"] in offered and rep["policy_updates"] == total + len(tried)
        chosen = next(u for u in rep["updates"] if u["arm_index"] == rep["arm_index"])
        assert rep["reward"] == chosen["reward"]
        total += len(tried)
    saved = BestFixed.load(policy)
    assert updates_of(saved) == total and np.allclose(saved.sums, p.policy.sums)
    # the saved file lost its last updates (a crash between two saves): replayed from the log, once
    stale = BestFixed(len(saved.arm_names), arm_names=saved.arm_names)
    stale.save(policy)
    again = _pipeline(world, tiny_models, policy_path=policy)
    assert len(train(again, queries, tmp_path / "train.jsonl", policy, epochs=1)) == len(records)
    back = BestFixed.load(policy)
    assert updates_of(back) == total and np.allclose(back.sums, saved.sums)


def test_serving_replays_a_full_information_record_from_where_the_policy_stands(world, tiny_models):  # noqa: F811
    from d2r_edge.runtime import Runtime

    p = _pipeline(world, tiny_models)
    rt = Runtime.__new__(Runtime)
    rt.pipeline = p
    updates = [{"arm_index": 2, "reward": 0.5, "latency_s": 0.1, "mem_growth_mib": 0.0},
               {"arm_index": 4, "reward": 1.0, "latency_s": 0.1, "mem_growth_mib": 0.0}]
    p.policy.update(2, None, 0.5)                                  # the first of the two is already in
    rep = {"x": [0.0], "policy_updates": 2, "updates": updates, "arm_index": 4, "reward": 1.0}
    assert rt.replay([rep]) == 1 and updates_of(p.policy) == 2 and p.policy.select() == 4
    assert rt.replay([rep]) == 0


def test_the_label_reward_is_whether_the_repaired_answer_is_right():
    from d2r_edge.config import Budget, RewardConfig, RewardQuality
    from d2r_edge.policy.reward import reward

    cfg = RewardConfig(quality=RewardQuality.LABEL)
    common = dict(no_failure=True, kg_consistent=True, nli_entailed=True, device_mem_mib=0.0,
                  budget=Budget(latency_s=4.0, device_mem_mib=6.0), cfg=cfg)
    # the indicators say "all good" in both: only the gold decides, then Eq. 2's cost terms
    assert reward(latency_s=1.0, right=True, **common) == pytest.approx(0.75)
    assert reward(latency_s=1.0, right=False, **common) == 0.0
    assert reward(latency_s=5.0, right=True, **common) == 0.0                   # over budget: gated
    with pytest.raises(PolicyError, match="train on labeled queries"):
        reward(latency_s=1.0, **common)


def test_train_with_the_label_reward_scores_every_tried_arm_by_the_gold(world, tiny_models, tmp_path):  # noqa: F811
    """Issue 51: with --reward-quality label each tried arm's reward is 1 exactly when its answer is right by
    the gold (no cost terms here), so the fixed policy's means are the arms' accuracies on the repaired
    training queries; without a gold (run, serve) the reward is refused, not guessed."""
    from d2r_edge.config import RewardConfig, RewardQuality
    from d2r_edge.errors import ConfigError
    from d2r_edge.runner import Query, answer_query

    _, _, qpath = world
    queries = load_queries(qpath)[:12]
    policy = tmp_path / "fixed.npz"
    cfg = RewardConfig(quality=RewardQuality.LABEL, gates=False, cost_weighting=False)
    p = _pipeline(world, tiny_models, policy_path=policy, create_policy=True, reward=cfg)
    records = train(p, queries, tmp_path / "train.jsonl", policy, epochs=1)
    repaired = [r for r in records if r.get("repair")]
    assert repaired and all(r["error"] is None for r in records)
    for r in repaired:
        rep = r["repair"]
        assert rep["reward_quality"] == "label" and {u["reward"] for u in rep["updates"]} <= {0.0, 1.0}
        assert rep["reward"] == float(r["final_correct"])        # the arm it kept: right by the gold or not
    # the policy's means are the tried arms' shares of right answers
    tried = p.policy.counts > 0
    assert np.all((p.policy.means()[tried] >= 0) & (p.policy.means()[tried] <= 1))
    assert p.policy.sums.sum() == sum(u["reward"] for r in repaired for u in r["repair"]["updates"])
    # a query with no gold: the record says why; answering without a grader refuses the label reward
    q = repaired[0]
    rec = answer_query(p, Query(id="x", text=q["query"], label=None, answer=None), learn=True)
    assert "no gold label or answer" in rec["error"]
    with pytest.raises(ConfigError, match="only `train` on labeled queries"):
        p.run(q["query"], learn=False)


def test_the_cli_keeps_the_label_reward_to_training_on_labeled_queries(tmp_path, capsys):
    from d2r_edge.cli import main
    from d2r_edge.errors import InputError

    fever = tmp_path / "q.jsonl"
    fever.write_text('{"id": 1, "claim": "Rome is in Italy.", "label": "SUPPORTS"}\n'
                     '{"id": 2, "claim": "Oslo is in Peru."}\n')
    common = ["--kb", str(tmp_path / "kb"), "--task", "fever", "--queries", str(fever), "--out",
              str(tmp_path / "o.jsonl"), "--models", str(tmp_path / "m"), "--reward-quality", "label"]
    assert main(["run", *common]) == InputError.exit_code
    assert "for `d2r-edge train` only" in capsys.readouterr().err
    assert main(["train", *common, "--policy", str(tmp_path / "p.npz")]) == InputError.exit_code
    assert "1 queries have none (first: 2)" in capsys.readouterr().err


def _cv_records(first: list[bool], finals: dict[str, list[bool]]) -> dict[str, list[dict]]:
    ids = [f"q{i}" for i in range(len(first))]
    recs = {"naive": [{"id": i, "first_correct": f, "final_correct": f, "repaired": False}
                      for i, f in zip(ids, first)]}
    for m, final in finals.items():
        recs[m] = [{"id": i, "first_correct": f, "final_correct": g, "repaired": f != g}
                   for i, f, g in zip(ids, first, final)]
    return recs


def test_the_training_cv_default_breaks_ties_by_fewer_broken_answers_not_by_the_methods_order():
    """Issue 51: at an equal delta the method that breaks fewer right answers wins, whatever order --methods
    listed them in; each task's current default is the one `run` uses (FEVER: the fixed arm)."""
    from d2r_edge.eval.method_cv import summarize

    first = [False] * 6 + [True] * 4
    careless = first[:]                       # 3 fixed, 2 broken: +1 net
    careless[0] = careless[1] = careless[2] = True
    careless[6] = careless[7] = False
    careful = first[:]                        # 2 fixed, 1 broken: +1 net
    careful[0] = careful[1] = True
    careful[6] = False
    for order in (("thompson", "linucb_accept"), ("linucb_accept", "thompson")):
        finals = {order[0]: careless if order[0] == "thompson" else careful,
                  order[1]: careless if order[1] == "thompson" else careful}
        cv = summarize(_cv_records(first, finals), fact_verification=False, folds=5, resamples=200, seed=0)
        assert cv["methods"]["thompson"]["delta_vs_naive"] == cv["methods"]["linucb_accept"]["delta_vs_naive"]
        assert cv["best_method"] == "linucb_accept" and cv["current_default"] == "thompson"
        assert cv["default_by_training_cv"] == "thompson"           # a default is a policy kind: no comparator
    # a policy kind that breaks fewer at the same delta replaces the current default
    cv = summarize(_cv_records(first, {"thompson": careless, "linucb": careful}), fact_verification=False,
                   folds=5, resamples=200, seed=0)
    assert cv["default_by_training_cv"] == "linucb"
    # FEVER: the fixed arm is the current default and keeps a tie it does not lose on broken answers
    cv = summarize(_cv_records(first, {"linucb": careful, "best_fixed": careful}), fact_verification=True,
                   folds=5, resamples=200, seed=0)
    assert cv["current_default"] == "best_fixed" and cv["default_by_training_cv"] == "best_fixed"
    cv = summarize(_cv_records(first, {"linucb": careful, "best_fixed": first}), fact_verification=True,
                   folds=5, resamples=200, seed=0)
    assert cv["default_by_training_cv"] == "linucb"
