"""Batch runs: `d2r-edge run` and `d2r-edge train` (Alg. 2), resumable, with a summary.

Output is JSONL, one record per query, appended and fsynced one at a time. A
rerun with the same output skips what is recorded (a torn last line from a
crash is cut and redone), so nothing is lost or duplicated. Training logs each
policy update (arm, x, reward) before saving the policy atomically; on resume,
updates logged but missing from the saved policy are replayed.
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from d2r_edge.config import RewardQuality
from d2r_edge.errors import RECOVERABLE, InputError
from d2r_edge.jsonl import loads as json_line
from d2r_edge.tasks import Task

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Query:
    id: str
    text: str
    label: str | None = None
    answer: str | None = None


def load_queries(path: Path) -> list[Query]:
    """FEVER-style {id, claim|question, label?} or HotpotQA-style {_id, question, answer?}."""
    out, bad, seen = [], [], set()
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read queries file {path}: {exc}") from None
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json_line(line)
            qid = str(row.get("id", row.get("_id")))
            text = row.get("claim") or row.get("question")
            if row.get("id", row.get("_id")) is None or not isinstance(text, str) or not text.strip():
                raise ValueError("needs id/_id and a non-empty claim or question")
            label, answer = row.get("label"), row.get("answer")
            if label is not None and not isinstance(label, str):
                raise ValueError(f"label must be a string, got {type(label).__name__}")
            if isinstance(answer, (int, float)) and not isinstance(answer, bool):
                answer = str(answer)            # a year or a count written as a number
            elif answer is not None and not isinstance(answer, str):
                raise ValueError(f"answer must be a string, got {type(answer).__name__}")
        except (json.JSONDecodeError, ValueError, AttributeError) as exc:
            bad.append((n, str(exc)[:80]))
            continue
        if qid in seen:
            bad.append((n, f"duplicate id {qid!r}"))
            continue
        seen.add(qid)
        out.append(Query(qid, text, label, answer))
    for n, why in bad:
        log.warning("%s line %d skipped: %s", path, n, why)
    if not out:
        raise InputError(f"{path} has no usable query ({len(bad)} broken line(s))")
    return out


Validator = Callable[[dict], bool]


def _scan(lines, valid: Validator | None, slim=None, drop=None) -> tuple[list, list[int], bool, int]:
    """(records - or `slim(record)` of each - not dropped, numbers of the lines that are not records,
    whether only the last line is bad (a torn write), how many records `drop` took out).
    `lines`: the file's lines with their newlines (a file object streams)."""
    records, bad, last, dropped, ends = [], [], 0, 0, True
    for n, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        last, ends = n, raw.endswith(b"\n")
        row = _record(raw, valid)
        if row is None:
            bad.append(n)
        elif drop is not None and drop(row):
            dropped += 1
        elif slim is None:
            records.append(row)
        elif (kept := slim(row)) is not None:      # slim: what a reader keeps of a record (None: nothing)
            records.append(kept)
    return records, bad, bad == [last] and not ends, dropped


def _record(raw: bytes, valid: Validator | None) -> dict | None:
    try:
        row = json_line(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return row if isinstance(row, dict) and (valid is None or _checked(valid, row)) else None


def _checked(valid: Validator, row: dict) -> bool:
    try:
        return bool(valid(row))
    except (KeyError, TypeError, ValueError, IndexError, AttributeError):
        return False


def read_records(path: Path, valid: Validator | None = None) -> list[dict]:
    """The complete records of a JSONL log without opening it for writing (lines that are not
    records, e.g. a torn last line, are left out)."""
    return scan_records(path, valid)[0]


def scan_records(path: Path, valid: Validator | None = None) -> tuple[list[dict], list[int]]:
    """`read_records` and the numbers of the lines it left out (the file is only read)."""
    if not Path(path).is_file():
        return [], []
    with open(path, "rb") as fh:
        records, bad, _, _ = _scan(fh, valid)
    return records, bad


def run_record_ok(rec: dict) -> bool:
    """A `run`/`train` record a resume can trust: its query id and pass, and an answer or an error."""
    return (isinstance(rec.get("id"), str) and isinstance(rec.get("epoch"), (int, type(None)))
            and (bool(rec.get("error")) or isinstance(rec.get("final_answer"), str)))


def is_error(rec: dict) -> bool:
    """A record that holds no answer (the query failed): a rerun does it again."""
    return bool(rec.get("error"))


class RecordLog:
    """Append-only JSONL with crash-safe resume: the one implementation of resumable JSONL
    (`run`, `train`, `eval answers`, the doctor).

    `drop`: records to take out when the log is opened (e.g. error records, so a rerun
    retries them); the file is then rewritten atomically (temp file, fsync, rename), so a
    kill during the rewrite leaves the old file or the new one, never a mix. Lines that are
    not records - a crash's torn last line, or damage anywhere (not JSON, not an object, or
    refused by `valid`, the log's own check of what its readers need) - are taken out the
    same way and redone; the good records around them are kept.
    """

    def __init__(self, path: Path, drop=None, valid: Validator | None = None, keep: bool = True,
                 slim=None) -> None:
        self.path = Path(path)
        # keep=False: the file is read a line at a time and appended records go to the file only, so
        # a long run's memory does not grow with its records; `records` then holds `slim(record)`
        # of the records found on open (what a resume needs, e.g. the ids), or nothing.
        self.keep = keep
        self.records: list = []
        damaged: list[int] = []
        dropped = 0
        if self.path.is_file():
            with open(self.path, "rb") as fh:
                records, damaged, torn, dropped = _scan(fh, valid, None if keep else slim, drop)
            self.records = records if keep or slim is not None else []
            if torn:
                log.warning("%s: cut a torn last record; it will be redone", self.path)
            elif damaged:
                # not a crash's torn write (that is only ever the last line): the file was damaged
                # or edited. Those lines are redone, every good record kept.
                shown = ", ".join(map(str, damaged[:10])) + (" ..." if len(damaged) > 10 else "")
                log.warning("%s: %d line(s) are not records of this log (line %s); they are taken out "
                            "and redone", self.path, len(damaged), shown)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if damaged or dropped:
            if keep:
                self.rewrite(self.records)
            else:
                self._rewrite_kept(valid, drop)
            if dropped:
                log.info("%s: %d record(s) taken out to be redone", self.path, dropped)
        self._fh = open(self.path, "a", encoding="utf-8")

    def _rewrite_kept(self, valid: Validator | None, drop) -> None:
        """keep=False's rewrite: the file's good lines not dropped, copied as they are, a line at a time
        (atomically, as `rewrite`)."""
        def lines():
            with open(self.path, "rb") as src:
                for raw in src:
                    row = _record(raw, valid) if raw.strip() else None
                    if row is not None and (drop is None or not drop(row)):
                        yield raw if raw.endswith(b"\n") else raw + b"\n"

        self._replace_with(lines())

    def rewrite(self, records: list[dict]) -> None:
        """Replace the file's records atomically (compaction); appends then continue on the new file."""
        appending = getattr(self, "_fh", None)
        if appending is not None and not appending.closed:
            appending.close()
        self._replace_with((json.dumps(rec, ensure_ascii=False) + "\n").encode("utf-8") for rec in records)
        self.records = list(records)
        if appending is not None:        # (from __init__, the log opens its file itself)
            self._fh = open(self.path, "a", encoding="utf-8")

    def _replace_with(self, lines) -> None:
        """The file becomes `lines` (bytes) atomically: temp file, fsync, rename, fsync of the directory."""
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "wb") as out:
            for line in lines:
                out.write(line)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, self.path)
        _fsync_dir(self.path.parent)

    def append(self, rec: dict) -> None:
        self._fh.write(json.dumps(rec, ensure_ascii=False) + "\n")
        self._fh.flush()
        os.fsync(self._fh.fileno())
        if self.keep:
            self.records.append(rec)

    def close(self) -> None:
        self._fh.close()


def _fsync_dir(directory: Path) -> None:
    """Make a rename durable (POSIX); a no-op where directories cannot be opened."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def correct(task: Task, q: dict, answer: str) -> bool | None:
    """FEVER: 3-way label match (UNVERIFIED counts as NOT ENOUGH INFO); QA: SQuAD exact match."""
    from d2r_edge.answers import exact_match, fever_label

    if task.fact_verification:
        return fever_label(answer) == fever_label(q["label"]) if q.get("label") else None
    if not q.get("answer"):
        return None
    return exact_match(answer, [str(q["answer"])]) == 1.0


def answer_query(pipeline, q: Query, learn: bool, epoch: int | None = None, deadline_s: float | None = None) -> dict:
    """One query's record; a per-query failure (generator down, ...) is recorded, not raised.

    A failure in the repair pass keeps the first answer as final (`repair_error` says what
    failed; Pipeline.run); only a failure before any answer leaves `error`, which a rerun retries.
    `deadline_s`: each query's wall-clock limit, generator calls and retries included."""
    rec = {"id": q.id, "epoch": epoch, "query": q.text, "gold_label": q.label,
           "gold_answer": q.answer, "task": pipeline.task.value}
    gold = {"label": q.label, "answer": q.answer}
    graded = learn and getattr(getattr(pipeline, "reward_cfg", None), "quality", None) is RewardQuality.LABEL
    try:
        if graded and correct(pipeline.task, gold, "") is None:
            raise InputError(f"query {q.id} has no gold label or answer: the label reward (--reward-quality "
                             f"label) trains on labeled queries only")
        rec.update(pipeline.run(q.text, learn, deadline_s,
                                (lambda answer: bool(correct(pipeline.task, gold, answer))) if graded else None))
        rec["first_correct"] = correct(pipeline.task, gold, rec["first_answer"])
        rec["final_correct"] = correct(pipeline.task, gold, rec["final_answer"])
        rec["error"] = None
    except RECOVERABLE as exc:  # one query's failure must not end the run
        log.warning("query %s failed: %s", q.id, exc)
        rec["error"] = f"{type(exc).__name__}: {exc}"
    return rec


def process(pipeline, queries: list[Query], out: Path, learn: bool, epoch: int | None = None,
            on_update=None, keep: bool = True, deadline_s: float | None = None) -> RecordLog:
    """Run queries not yet in `out`; errors are recorded per query and the run goes on.

    `keep=False`: no record stays in memory (`run` over a long query stream: memory does not grow
    with the queries answered); the returned log's `records` is then empty, `summary_of` reads the file."""
    from tqdm import tqdm

    # a query of this pass that failed before is tried again
    def key(r: dict) -> tuple:
        return r.get("epoch"), r["id"]

    rlog = RecordLog(out, drop=lambda r: is_error(r) and r.get("epoch") == epoch, keep=keep, valid=run_record_ok,
                     slim=key)
    done = set(map(key, rlog.records) if keep else rlog.records)
    if not keep:
        rlog.records = []
    todo = [q for q in queries if (epoch, q.id) not in done]
    try:
        for q in tqdm(todo, desc="queries" if epoch is None else f"epoch {epoch}", disable=None):
            rec = answer_query(pipeline, q, learn, epoch, deadline_s)
            rlog.append(rec)
            if on_update is not None and rec.get("repair") and learn:
                on_update(rec)
    finally:
        rlog.close()
    return rlog


_SUMMARY_KEYS = ("id", "epoch", "error", "failure", "repair", "repair_skipped", "repair_error", "first_correct",
                 "final_correct", "total_s", "first_answer", "final_answer", "task", "gold_answer")


def summary_of(path: Path) -> str:
    """`summary` of a record file, read a line at a time keeping only what the summary shows."""
    slim = []
    with open(path, "rb") as fh:
        for line in fh:
            try:
                rec = json_line(line) if line.strip() else None
            except (json.JSONDecodeError, UnicodeDecodeError):
                rec = None
            if isinstance(rec, dict) and "id" in rec:
                row = {k: rec.get(k) for k in _SUMMARY_KEYS}
                row["final"] = {"failure": (rec.get("final") or {}).get("failure")}
                slim.append(row)
    return summary(slim)


def summary(records: list[dict]) -> str:
    """Failure-type counts, arm counts, accuracy/EM, latency percentiles, budget violations.

    Records are taken in id order: a `--engine ray` run writes them as batches finish.
    """
    records = sorted(records, key=lambda r: (str(r["id"]), r.get("epoch") or 0))
    ok = [r for r in records if not r.get("error")]
    lines = [f"queries: {len(records)} ({len(records) - len(ok)} with errors)"]
    fails = Counter(r["failure"] for r in ok)
    lines.append("failure types: " + ", ".join(f"{k} {v}" for k, v in fails.most_common()))
    arms = Counter(r["repair"]["arm"] for r in ok if r.get("repair"))
    lines.append("arms: " + (", ".join(f"{k} {v}" for k, v in arms.most_common()) or "none"))
    off = {k: v for r in ok for k, v in ((r.get("repair") or r.get("repair_skipped") or {}).get("unavailable")
                                         or {}).items()}
    if off:
        lines.append("arms off (the loaded models cannot run them): "
                     + "; ".join(f"{k} ({v})" for k, v in sorted(off.items())))
    failed = sum(1 for r in ok if r.get("repair_error"))
    if failed:
        lines.append(f"repairs that failed (first answer kept, see repair_error): {failed}")
    skipped = sum(1 for r in ok if r.get("repair_skipped"))
    if skipped:
        lines.append(f"failures left unrepaired (no allowed arm can run): {skipped}")
    for which in ("first", "final"):
        vals = [r[f"{which}_correct"] for r in ok if r.get(f"{which}_correct") is not None]
        if vals:
            name = "naive (first answer)" if which == "first" else "D2R (final answer)"
            lines.append(f"{name} accuracy/EM: {np.mean(vals):.3f} over {len(vals)}")
    lines += _containment(ok)
    lines += _trust(ok)
    tot = [r["total_s"] for r in ok]
    if tot:
        lines.append(f"per-query latency p50 {np.percentile(tot, 50):.3f} s, p95 {np.percentile(tot, 95):.3f} s")
    rep = [r["repair"] for r in ok if r.get("repair")]
    if rep:
        lat = [x["latency_s"] for x in rep]
        over = sum(x["over_budget"] for x in rep)
        lines.append(f"repair latency p50 {np.percentile(lat, 50):.3f} s, p95 {np.percentile(lat, 95):.3f} s; "
                     f"budget violations {over}/{len(rep)}; memory kind {rep[0]['memory_kind']}")
    lines += _repairs(ok)
    return "\n".join(lines)


def _trust(ok: list[dict]) -> list[str]:
    """With a trust certificate: the share of answers trusted and, where gold exists, their error."""
    judged = [r for r in ok if isinstance(r.get("trusted"), bool)]
    if not judged:
        return []
    trusted = [r for r in judged if r["trusted"]]
    graded = [r["final_correct"] for r in trusted if r.get("final_correct") is not None]
    eps = (judged[0].get("trust") or {}).get("epsilon")
    line = (f"trusted answers: {len(trusted)}/{len(judged)} ({len(trusted) / len(judged):.1%} coverage; certified "
            f"error <= {eps}), abstained {sum(1 for r in judged if r.get('abstained'))}")
    if graded:
        line += f"; wrong among the trusted: {1 - np.mean(graded):.3f} over {len(graded)}"
    return [line]


def _containment(ok: list[dict]) -> list[str]:
    """QA: how often the answer holds the gold answer (sentence answers have EM 0 by construction)."""
    from d2r_edge.answers import contains_answer

    qa = [r for r in ok if r.get("task") == Task.QA.value and r.get("gold_answer")]
    if not qa:
        return []
    first, final = ([contains_answer(r.get(f"{w}_answer") or "", [str(r["gold_answer"])]) for r in qa]
                    for w in ("first", "final"))
    return [f"answers holding the gold answer: first {int(sum(first))}/{len(qa)}, final {int(sum(final))}/{len(qa)}"]


def _clip(text, n: int = 60) -> str:
    text = " ".join(str(text or "").split())
    return text if len(text) <= n else text[: n - 3] + "..."


def _repairs(records: list[dict], show: int = 8) -> list[str]:
    """What the repairs did: answer before and after, and whether that was right."""
    rep = [r for r in records if r.get("repair")]
    if not rep:
        return []
    mark = {True: "right", False: "wrong", None: "no gold"}
    changed = [r for r in rep if r["first_answer"] != r["final_answer"]]
    fixed = sum(1 for r in rep if r.get("first_correct") is False and r.get("final_correct") is True)
    broken = sum(1 for r in rep if r.get("first_correct") is True and r.get("final_correct") is False)
    out = [f"repairs: {len(rep)} ({len(changed)} changed the answer; {fixed} wrong -> right, {broken} right -> wrong)"]
    for r in (changed + [r for r in rep if r not in changed])[:show]:
        final = r["final"]["failure"]
        out.append(f"  {r['id']}: {r['failure']} -> {r['repair']['arm']} -> {final}; "
                   f"{_clip(r['first_answer'])!r} ({mark[r.get('first_correct')]}) -> "
                   f"{_clip(r['final_answer'])!r} ({mark[r.get('final_correct')]})")
    return out
