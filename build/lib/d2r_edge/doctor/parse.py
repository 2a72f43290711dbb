"""Agent trajectories in, typed `Trajectory` out: ReAct-FEVER, Reflexion, FireAct and our JSONL.

Formats (`--format`, `auto` detects it from the first record's keys):

- `react_fever`: the ReAct authors' FEVER runs: `claim`, `trajectory` ("Thought 1: ...\\n
  Action 1: Search[...]\\nObservation 1: ..."), `answer`, `gt_answer`.
- `reflexion`: Reflexion's ReAct scratchpads: `question`, `key` (gold), `answer` (absent when the
  agent halted), `scratchpad` in the numbered Thought/Action/Observation layout.
- `fireact`: FireAct episodes: `traj` as chat messages (GPT-3.5) or one Alpaca-format string
  (Llama), unnumbered "Thought: / Action: search[...] / Observation:", `pred`, `gt`.
- `jsonl`, for your own agent, one object per line:
  `{"question": str, "gold": str | [str, ...], "prediction": str | null, "task": "qa" | "fever",
    "steps": [{"type": "reasoning" | "search" | "lookup" | "evidence" | "answer", "text": str}, ...]}`
  An `evidence` step belongs to the search before it.

A record that cannot be parsed is reported with its line and skipped, never a crash.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Iterator

from d2r_edge.doctor.trajectory import Trajectory, TrajectoryBuilder
from d2r_edge.errors import InputError
from d2r_edge.jsonl import loads as json_line

log = logging.getLogger(__name__)


class TrajectoryFormat(str, Enum):
    AUTO = "auto"
    REACT_FEVER = "react_fever"
    REFLEXION = "reflexion"
    FIREACT = "fireact"
    JSONL = "jsonl"


@dataclass(frozen=True)
class ParseIssue:
    line: int
    reason: str


# "Thought 3: ...", "Action: search[x]", "Observation 2: ..." at the start of a line
_EVENT = re.compile(r"^(Thought|Action|Observation)(?:\s*\d+)?\s*:\s?", re.M)
_CALL = re.compile(r"^\s*(\w+)\s*\[(.*)\]\s*$", re.S)
_FEVER_LABELS = {"SUPPORTS", "REFUTES", "NOT ENOUGH INFO"}


class ParseError(InputError):
    """One record that is not a trajectory of the format (reported with its line, then skipped)."""


def _events(text: str) -> Iterator[tuple[str, str]]:
    marks = list(_EVENT.finditer(text))
    for m, nxt in zip(marks, marks[1:] + [None]):
        yield m.group(1), text[m.end():nxt.start() if nxt else len(text)].strip()


def _build(text: str) -> TrajectoryBuilder:
    b = TrajectoryBuilder()
    seen = False
    for kind, body in _events(text):
        seen = True
        if kind == "Thought":
            b.thought(body)
        elif kind == "Action":
            call = _CALL.match(body)
            if call is None or call.group(1).lower() not in ("search", "lookup", "finish"):
                b.invalid_action(body)
            else:
                b.action(call.group(1), call.group(2))
        elif body.lower().startswith("invalid action"):
            b.retract()
        else:
            b.observation(body)
    if not seen:
        raise ParseError("no Thought/Action/Observation lines")
    return b


def _bool(v) -> bool | None:
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.strip().lower() in ("true", "false"):
        return v.strip().lower() == "true"
    if isinstance(v, (int, float)):
        return bool(v)
    return None


def _react_fever(row: dict, line: int) -> Trajectory:
    b = _build(row["trajectory"])
    gold = row.get("gt_answer") or row.get("paper_dev_label")
    return Trajectory(line, row["claim"], row.get("answer") or b.answer, (str(gold),), tuple(b.steps),
                      TrajectoryFormat.REACT_FEVER.value, task="fever", meta={"em": _bool(row.get("em"))})


def _reflexion(row: dict, line: int) -> Trajectory:
    b = _build(row["scratchpad"])
    return Trajectory(line, row["question"], row.get("answer") or b.answer, (str(row["key"]),), tuple(b.steps),
                      TrajectoryFormat.REFLEXION.value, meta={"halted": "answer" not in row})


def _fireact(row: dict, line: int) -> Trajectory:
    traj = row["traj"]
    if isinstance(traj, list):         # chat messages: the first user turn is the question
        question = row.get("derived_dev_question") or traj[0]["content"]
        text = "\n".join(m["content"] for m in traj[1:])
    else:
        m = re.search(r"### Instruction:\s*(.*?)\s*### Response:\s*(.*)$", traj, re.S)
        if m is None:
            raise ParseError("Alpaca-format traj without '### Instruction:' / '### Response:'")
        question, text = row.get("derived_dev_question") or m.group(1), m.group(2)
    b = _build(text)
    return Trajectory(line, question, row.get("pred") if row.get("pred") is not None else b.answer,
                      (str(row["gt"]),), tuple(b.steps), TrajectoryFormat.FIREACT.value,
                      meta={"em": _bool(row.get("em")), "model": row.get("model")})


def _jsonl(row: dict, line: int) -> Trajectory:
    b = TrajectoryBuilder()
    for step in row["steps"]:
        kind, text = step["type"], str(step["text"])
        if kind == "reasoning":
            b.thought(text)
        elif kind in ("search", "lookup"):
            b.action(kind, text)
        elif kind == "evidence":
            b.observation(text)
        elif kind == "answer":
            b.action("finish", text)
        else:
            raise ParseError(f"step type {kind!r} is not reasoning, search, lookup, evidence or answer")
    gold = row["gold"]
    gold = tuple(str(g) for g in gold) if isinstance(gold, list) else (str(gold),)
    task = row.get("task", "qa")
    if task not in ("qa", "fever"):
        raise ParseError(f"task {task!r} is not qa or fever")
    return Trajectory(line, row["question"], row.get("prediction", b.answer), gold, tuple(b.steps),
                      TrajectoryFormat.JSONL.value, task=task)


_PARSERS = {TrajectoryFormat.REACT_FEVER: _react_fever, TrajectoryFormat.REFLEXION: _reflexion,
            TrajectoryFormat.FIREACT: _fireact, TrajectoryFormat.JSONL: _jsonl}


def detect(row: dict) -> TrajectoryFormat:
    if "trajectory" in row and "claim" in row:
        return TrajectoryFormat.REACT_FEVER
    if "scratchpad" in row:
        return TrajectoryFormat.REFLEXION
    if "traj" in row:
        return TrajectoryFormat.FIREACT
    if isinstance(row.get("steps"), list) and "question" in row:
        return TrajectoryFormat.JSONL
    raise InputError(f"cannot tell the trajectory format from the keys {sorted(row)[:8]}; pass --format "
                     f"{'|'.join(f.value for f in TrajectoryFormat if f is not TrajectoryFormat.AUTO)}")


@dataclass
class Parsed:
    trajectories: list[Trajectory]
    issues: list[ParseIssue]
    format: TrajectoryFormat


def parse_file(path: Path, fmt: TrajectoryFormat = TrajectoryFormat.AUTO) -> Parsed:
    """Every parsable record of `path`; the others as issues with their line."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"no trajectory file at {path}")
    out, issues, undetected = [], [], None
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise InputError(f"{path} is not UTF-8 ({exc.reason} at byte {exc.start}); re-encode it") from None
    except OSError as exc:
        raise InputError(f"cannot read trajectory file {path}: {exc}") from None
    for line, text in enumerate(lines, 1):
        if not text.strip():
            continue
        try:
            row = json_line(text)
            if not isinstance(row, dict):
                raise ParseError("a JSON object per line is expected")
            if fmt is TrajectoryFormat.AUTO:       # the first readable record decides
                try:
                    fmt = detect(row)
                except InputError as exc:
                    undetected = InputError(f"{path} line {line}: {exc}")
                    raise
            out.append(_PARSERS[fmt](row, line))
        except InputError as exc:
            issues.append(ParseIssue(line, str(exc)))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError, ValueError, IndexError) as exc:
            issues.append(ParseIssue(line, f"{type(exc).__name__}: {exc}"))
    if not out:
        if undetected is not None:
            raise undetected
        raise InputError(f"{path} holds no trajectories" + (f" (line {issues[0].line}: {issues[0].reason})"
                                                           if issues else ""))
    for issue in issues:
        log.warning("%s line %d skipped: %s", path.name, issue.line, issue.reason)
    return Parsed(out, issues, fmt)


def is_fever_label(text: str | None) -> bool:
    return (text or "").strip().upper() in _FEVER_LABELS
