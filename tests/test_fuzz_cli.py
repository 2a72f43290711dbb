"""The `d2r-edge` command line as a whole, driven with generated arguments and files.

Each example picks a subcommand, then flags from its argparse definition with
values drawn from a pool per kind of flag: valid ones (the demo KB and queries,
the tiny models), and wrong ones (missing paths, directories where files belong,
damaged files, bad numbers, an unreachable server). The property: exit 0, or
argparse's usage error (2), or one `d2r-edge: error:` line with the exit code of
the error's class; never a traceback, never the internal-error exit.

Bounded: the number of examples (D2R_FUZZ_EXAMPLES / 6 by default, more with
`-m slow`). Left out: `export` (minutes per valid call; its errors are tested in
test_export.py), `eval retrieval` (builds KBs over ../shared/data), `serve` (a valid call serves
until signalled; its bad flags and inputs are tested in test_serve.py) and `--engine ray` (starts a
Ray cluster; tested in test_ray_engine.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from stand_ins import longer, search_longer

from d2r_edge import errors
from d2r_edge.cli import INTERNAL_ERROR_EXIT, OS_ERROR_EXIT, build_parser, main
from d2r_edge.generate.openai_compat import GeneratorError
from d2r_edge.retrieval.kb import KBError

EXAMPLES = int(os.environ.get("D2R_FUZZ_EXAMPLES", "60"))
FUZZ = settings(max_examples=max(6, EXAMPLES // 4), deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
DEMO = Path(__file__).resolve().parent.parent / "d2r_edge" / "data" / "demo"
SKIPPED = {("export",), ("eval", "retrieval"), ("serve",)}   # serve: runs until signalled (tests/test_serve.py)
FIXED = {"--engine": "local"}

_codes = {cls.exit_code for cls in vars(errors).values() if isinstance(cls, type) and issubclass(cls, errors.D2RError)}
ALLOWED_CODES = _codes | {KBError.exit_code, GeneratorError.exit_code, OS_ERROR_EXIT, 2}


def _leaves(parser: argparse.ArgumentParser, path=()):
    """(command path, leaf parser) for every subcommand."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield path, parser
        return
    for name, child in subs[0].choices.items():
        yield from _leaves(child, path + (name,))


LEAVES = [(path, p) for path, p in _leaves(build_parser()) if path[:2] not in SKIPPED and path[:1] not in SKIPPED]


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_models):
    """What valid values point at: the demo KB built with the tiny models, demo queries, a trajectory file,
    and damaged copies of each."""
    from d2r_edge.onnx.encoders import Embedder
    from d2r_edge.onnx.manifest import load_manifest
    from d2r_edge.retrieval.kb import KnowledgeBase

    root = tmp_path_factory.mktemp("clifuzz")
    KnowledgeBase.build(DEMO / "docs.jsonl", root / "kb", Embedder(load_manifest(tiny_models),
                                                                    allow_random_weights=True))
    traj = {"question": "Which river runs past the old mill?", "gold": "the Aller",
            "steps": [{"type": "thought", "text": "I should look up the mill."},
                      {"type": "search", "text": "old mill river", "observation": "The mill stands on the Wenne."},
                      {"type": "answer", "text": "the Wenne"}]}
    (root / "traj.jsonl").write_text(json.dumps(traj) + "\n", encoding="utf-8")
    (root / "garbage.jsonl").write_bytes(b'{"id": 1, "claim": [1]}\n\xff\xfe\n[[[[\n{"text": "torn')
    (root / "empty.jsonl").write_text("")
    (root / "policy-garbage.npz").write_bytes(b"PK\x03\x04 not a zip")
    (root / "nomanifest").mkdir()
    return {"root": root, "models": tiny_models, "kb": root / "kb"}


def _mostly(valid: list[str], wrong: list[str]) -> st.SearchStrategy:
    """A valid value three times in four: most examples must get past argparse and into the command."""
    return st.one_of(st.sampled_from(valid), st.sampled_from(wrong)) if not valid else st.sampled_from(
        valid * max(1, 3 * len(wrong) // len(valid)) + wrong)


def _pool(world: dict, dest: str, action: argparse.Action, tmp: Path) -> st.SearchStrategy:
    root = world["root"]
    missing = str(root / "does-not-exist" / "x")
    a_dir = str(root / "nomanifest")
    if action.choices:
        return _mostly(sorted(map(str, action.choices)), ["not-a-choice"])
    if action.type is int:
        return _mostly(["1", "2", "3"], ["0", "-1", "abc", "999999999999"])
    if action.type is float:
        return _mostly(["0.5", "2.0", "3"], ["0", "-1", "nan", "inf", "x"])
    if dest == "models":
        return _mostly([str(world["models"])], [missing, a_dir, str(root / "garbage.jsonl")])
    if dest == "kb":   # this example's copy: a drawn `index build|refresh|compact` must not rewrite the shared KB
        return _mostly([str(tmp / "kb")], [missing, a_dir, str(root / "traj.jsonl")])
    if dest in ("queries", "train", "test", "refresh_pool", "extra_docs"):
        return _mostly([str(DEMO / "claims.jsonl"), str(DEMO / "questions.jsonl")],
                       [str(DEMO / "docs.jsonl"), str(root / "garbage.jsonl"), str(root / "empty.jsonl"), missing,
                        a_dir])
    if dest == "docs":
        return _mostly([str(DEMO / "docs.jsonl")], [str(DEMO / "claims.jsonl"), str(root / "garbage.jsonl"),
                                                    str(root / "empty.jsonl"), missing, a_dir])
    if dest == "trajectories":
        return _mostly([str(root / "traj.jsonl")], [str(root / "garbage.jsonl"), missing, a_dir])
    if dest == "out":
        return _mostly([str(tmp / "out.jsonl"), str(tmp / "nested" / "out")], [a_dir, str(tmp / "outdir")])
    if dest == "generation_cache":
        return _mostly([str(tmp / "gen.jsonl")], [a_dir, str(root / "garbage.jsonl")])
    if dest in ("policy", "detector"):
        return _mostly([str(tmp / "p.npz")], [str(root / "policy-garbage.npz"), a_dir, missing])
    if dest == "base_url":
        return st.sampled_from(["http://127.0.0.1:9/v1", "not a url", ""])
    if dest == "methods":
        return _mostly(["naive,oracle", "naive"], ["naive,nope", "", ",,"])
    return st.sampled_from(["x", "", "--", "é" * 3, "a=b"])


def _valid(world: dict, path: tuple, dest: str, tmp: Path) -> str | None:
    """A value that makes the command run to the end (None: leave the flag out)."""
    kb = str(tmp / "kb")
    return {"kb": kb, "models": str(world["models"]), "task": "fever", "queries": str(DEMO / "claims.jsonl"),
            "train": str(DEMO / "claims.jsonl"), "test": str(DEMO / "claims.jsonl"), "out": str(tmp / "out"),
            "trajectories": str(world["root"] / "traj.jsonl"), "docs": str(DEMO / "docs.jsonl"),
            "limit": "2", "train_limit": "4", "test_limit": "3", "bootstrap": "100", "epochs": "1",
            "methods": "naive,oracle" if path[0] == "eval" else None,
            "base_url": "http://127.0.0.1:9/v1"}.get(dest)


@st.composite
def _argv(draw, world: dict, tmp: Path) -> list[str]:
    """A command that runs as given, then 0-3 changes: a flag set to a drawn value (often a wrong one),
    or a required flag dropped."""
    path, parser = draw(st.sampled_from(LEAVES))
    shutil.copytree(world["kb"], tmp / "kb")
    if path == ("index",):
        path = ("index", draw(st.sampled_from(["build", "add", "refresh", "stats"])))
        if path[1] == "build":
            shutil.rmtree(tmp / "kb")
    args: dict[str, list[str]] = {}
    options = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    for action in options:
        flag = action.option_strings[-1]
        value = FIXED.get(flag) or _valid(world, path, action.dest, tmp)
        if value is not None and (action.required or action.dest in ("models", "limit", "train_limit", "test_limit",
                                                                     "bootstrap", "epochs", "methods", "docs")):
            args[flag] = [flag, value]
    if any(a.dest == "allow_random_weights" for a in options):
        args["--allow-random-weights"] = ["--allow-random-weights"]
    for _ in range(draw(st.integers(0, 3))):
        action = draw(st.sampled_from(options))
        flag = action.option_strings[-1]
        if flag in FIXED:
            continue
        if flag in args and draw(st.sampled_from([False, False, True])):
            del args[flag]
        elif action.nargs == 0:
            args[flag] = [flag]
        else:
            args[flag] = [flag, draw(_pool(world, action.dest, action, tmp))]
    return [*path, *(tok for toks in args.values() for tok in toks)]


OUTCOMES: list[int] = []


def _check(argv: list[str], capsys) -> None:
    try:
        rc = main(argv)
    except SystemExit as exc:                  # argparse: usage error (2) or --help (0)
        rc = exc.code
    out = capsys.readouterr()
    OUTCOMES.append(rc)
    assert "Traceback" not in out.err, (argv, out.err[-3000:])
    assert rc != INTERNAL_ERROR_EXIT, (argv, out.err[-2000:])
    assert rc == 0 or rc in ALLOWED_CODES, (argv, rc, out.err[-2000:])
    if rc not in (0, 2):
        errs = [ln for ln in out.err.splitlines() if ln.startswith("d2r-edge: error:")]
        assert len(errs) == 1, (argv, out.err[-2000:])


@FUZZ
@given(data=st.data())
def test_the_cli_with_generated_arguments_exits_cleanly(world, tmp_path_factory, capsys, data):
    tmp = tmp_path_factory.mktemp("cli")
    (tmp / "outdir").mkdir()
    argv = data.draw(_argv(world, tmp))
    _check(argv, capsys)


def test_the_generated_calls_reached_the_commands():
    """Not only argparse's usage errors: some calls ran to the end, some failed inside a command."""
    if not OUTCOMES:
        pytest.skip("the fuzz test did not run in this session")
    print("exit codes:", {rc: OUTCOMES.count(rc) for rc in sorted(set(OUTCOMES))})
    assert OUTCOMES.count(0) >= 2 and sum(rc not in (0, 2) for rc in OUTCOMES) >= 2, OUTCOMES


def test_internal_errors_are_one_line_unless_debugging(monkeypatch, capsys, world):
    """An exception d2r-edge did not raise on purpose: one line and exit 70; --debug / D2R_DEBUG=1 re-raise it."""
    import d2r_edge.cli as cli

    def boom(args):
        raise ZeroDivisionError("division by zero somewhere deep")

    monkeypatch.setattr(cli, "cmd_index", boom)
    argv = ["index", "stats", "--kb", str(world["kb"])]
    monkeypatch.delenv("D2R_DEBUG", raising=False)
    assert main(argv) == INTERNAL_ERROR_EXIT
    err = capsys.readouterr().err
    assert "Traceback" not in err and "internal error" in err and "ZeroDivisionError" in err
    with pytest.raises(ZeroDivisionError):
        main(["--debug", *argv])
    monkeypatch.setenv("D2R_DEBUG", "1")
    with pytest.raises(ZeroDivisionError):
        main(argv)


def test_an_os_error_is_one_line_with_its_own_exit_code(capsys, world, tmp_path):
    """--out that is a directory: the OS refuses the write; one line, exit 13."""
    (tmp_path / "dir").mkdir()
    rc = main(["run", "--kb", str(world["kb"]), "--task", "fever", "--queries", str(DEMO / "claims.jsonl"),
               "--out", str(tmp_path / "dir"), "--models", str(world["models"]), "--allow-random-weights",
               "--limit", "1"])
    err = capsys.readouterr().err
    assert rc in (OS_ERROR_EXIT, errors.InputError.exit_code) and "Traceback" not in err, err
    assert len([ln for ln in err.splitlines() if ln.startswith("d2r-edge: error:")]) == 1


@pytest.mark.slow
def test_cli_with_more_examples(tiny_models):
    """The same property searched 2x longer (the `slow` step; 5x under `.ci/run --full`)."""
    search_longer(__file__, EXAMPLES * longer(2, 5), D2R_TINY_MODELS=str(tiny_models))
