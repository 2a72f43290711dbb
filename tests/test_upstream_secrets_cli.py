"""`run`, `eval answers` and `doctor` with an OpenAI-compatible generator whose 401 body quotes the
key it was sent: records, stdout and stderr hold the status and the URL, never the key or the body."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from stand_ins import DEMO, ScriptedServer, quoting_the_key

from d2r_edge.cli import main
from d2r_edge.generate.openai_compat import GeneratorError

KEY = "sk-secret-123"


@pytest.fixture
def refusing(monkeypatch):
    """An upstream answering every call 401 with the key quoted back; the key in the environment."""
    monkeypatch.setenv("D2R_UPSTREAM_KEY", KEY)
    with ScriptedServer() as srv:
        srv.replies = [(401, quoting_the_key)] * 64
        yield srv


def _generator(url: str) -> list[str]:
    return ["--generator", "openai", "--base-url", url, "--api-key-env", "D2R_UPSTREAM_KEY"]


def _clean(capsys) -> str:
    out = capsys.readouterr()
    text = out.out + out.err
    assert KEY not in text and "Incorrect API key" not in text.replace("Incorrect API key provided: [redacted]", "")
    return text


def test_run_records_the_status_never_the_key(refusing, demo_kb, tiny_models, tmp_path, capsys):
    queries = tmp_path / "q.jsonl"
    queries.write_text("".join(line + "\n" for line in (DEMO / "questions.jsonl").read_text().splitlines()[:2]))
    out = tmp_path / "records.jsonl"
    assert main(["run", "--kb", str(demo_kb), "--task", "qa", "--queries", str(queries), "--out", str(out),
                 "--models", str(tiny_models), "--allow-random-weights", "--deadline-ms", "20000",
                 *_generator(refusing.url)]) == 0
    raw = out.read_bytes()
    assert KEY.encode() not in raw and b"Incorrect API key" not in raw
    errors = [json.loads(line)["error"] for line in raw.splitlines()]
    assert len(errors) == 2 == len(refusing.seen)           # one call per query: a 401 is not retried
    assert all("upstream answered HTTP 401 Unauthorized (attempt 1 of 4)" in e for e in errors), errors
    assert "Incorrect API key provided: [redacted]" in _clean(capsys)    # the log keeps a redacted excerpt


def test_eval_answers_stops_with_the_status_never_the_key(refusing, tiny_models, shared_data, tmp_path, capsys):
    fever = tmp_path / "fever.jsonl"
    fever.write_text("".join(line + "\n" for line in
                             (shared_data / "fever" / "dev.jsonl").read_text().splitlines()[:8]))
    code = main(["eval", "answers", "--task", "fever", "--train", str(fever), "--test", str(fever),
                 "--split", "all", "--train-limit", "2", "--test-limit", "2", "--models", str(tiny_models),
                 "--allow-random-weights", "--out", str(tmp_path / "out"), "--methods", "naive",
                 *_generator(refusing.url)])
    assert code == GeneratorError.exit_code
    text = _clean(capsys)
    assert "upstream answered HTTP 401 Unauthorized" in text and refusing.url in text
    for path in (tmp_path / "out").rglob("*"):
        if path.is_file():
            assert KEY.encode() not in path.read_bytes(), path


def test_doctor_llm_diagnoser_stops_with_the_status_never_the_key(refusing, tiny_models, tmp_path, capsys):
    row = {"question": "Which band released Abbey Road?", "gold": "The Beatles", "prediction": "Queen",
           "steps": [{"type": "reasoning", "text": "I need to search Abbey Road."},
                     {"type": "search", "text": "Abbey Road"},
                     {"type": "evidence", "text": "Abbey Road is an album by the Beatles."},
                     {"type": "answer", "text": "Queen"}]}
    src = tmp_path / "t.jsonl"
    src.write_text(json.dumps(row) + "\n")
    out = tmp_path / "d.jsonl"
    code = main(["doctor", "diagnose", "--trajectories", str(src), "--out", str(out), "--models", str(tiny_models),
                 "--allow-random-weights", "--diagnoser", "llm", *_generator(refusing.url)[2:]])
    assert code == GeneratorError.exit_code and len(refusing.seen) == 1
    assert "upstream answered HTTP 401 Unauthorized" in _clean(capsys)
    for path in Path(tmp_path).glob("d.jsonl*"):
        assert KEY.encode() not in path.read_bytes()
