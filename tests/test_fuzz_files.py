"""Model manifests, knowledge-base directories and eval --out folders, damaged in generated ways.

The property, as for the line readers (test_fuzz_readers.py): what d2r-edge reads
back either works or ends in one `D2RError` subclass whose message names the file
or directory; never another exception, and never a result that differs from the
undamaged one without saying so. `D2R_FUZZ_EXAMPLES` scales the search; `-m slow`
searches longer.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from stand_ins import hash_nli_scores, longer, search_longer

from d2r_edge.errors import D2RError

EXAMPLES = int(os.environ.get("D2R_FUZZ_EXAMPLES", "60"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
# the examples that run the whole CLI are 20x dearer: fewer of them
FUZZ_CLI = settings(FUZZ, max_examples=max(4, EXAMPLES // 6))

_text = st.one_of(st.text(max_size=20), st.sampled_from(["", "\x00", "../x", "/etc/passwd", "é", "x" * 3000]))
_scalar = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), _text)
_json = st.recursive(_scalar, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                      st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                     max_leaves=8)


def _paths(tree, prefix=()):
    """Every path to a value inside a JSON tree (dict keys and list indices)."""
    yield prefix
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from _paths(v, prefix + (i,))


@st.composite
def _mutated(draw, tree):
    """`tree` with one value replaced by any JSON value, or one key deleted."""
    tree = copy.deepcopy(tree)
    paths = [p for p in _paths(tree) if p]
    path = draw(st.sampled_from(paths))
    parent = tree
    for step in path[:-1]:
        parent = parent[step]
    if isinstance(parent, dict) and draw(st.booleans()):
        del parent[path[-1]]
    else:
        parent[path[-1]] = draw(_json)
    return tree


def _damage_bytes(raw: bytes, how: str) -> bytes:
    return {"empty": b"", "half": raw[: len(raw) // 2], "last_byte": raw[:-1], "garbage": b"\xff\xfe\x00garbage",
            "nul_tail": raw + b"\x00", "bom": b"\xef\xbb\xbf" + raw, "deep": b"[" * 5000 + b"]" * 5000}[how]


_BYTE_DAMAGE = st.sampled_from(["empty", "half", "last_byte", "garbage", "nul_tail", "bom", "deep"])


def _names(exc: Exception, *paths: Path) -> bool:
    text = str(exc)
    return any(str(p) in text or p.name in text for p in paths)


# --- models/<profile>/manifest.json --------------------------------------------------------------

def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _manifest_dir(root: Path) -> tuple[Path, dict]:
    """A manifest of two roles whose listed files exist with the recorded sizes and hashes."""
    files = {"nli/tokenizer.json": b'{"t": 1}', "nli/model.onnx": b"fp32 graph", "nli/model_int8.onnx": b"int8",
             "triples/tokenizer.json": b"{}", "triples/decoder.onnx": b"dec"}
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)

    def entry(name):
        return {"sha256": _sha(files[name]), "size_bytes": len(files[name])}

    manifest = {
        "format_version": 1, "profile": "fuzz", "absent": {"reranker": "not exported"}, "tools": {"onnx": "1"},
        "roles": {
            "nli": {"directory": "nli", "architecture": "bert", "task": "nli-3way", "weights": "trained",
                    "max_length_tokens": 128, "id2label": {"0": "entailment", "1": "neutral", "2": "contradiction"},
                    "source": {"kind": "local", "spec": "x", "weights_sha256": "ab"},
                    "files": {"tokenizer.json": entry("nli/tokenizer.json")},
                    "variants": {"fp32": {"files": {"model.onnx": entry("nli/model.onnx")}},
                                 "int8": {"files": {"model_int8.onnx": entry("nli/model_int8.onnx")},
                                          "quantization": {"fp32_rescore_margin": 0.1}}}},
            "triples": {"directory": "triples", "architecture": "bart", "task": "seq2seq", "weights": "random",
                        "max_length_tokens": 256, "generation": {"max_length": 64, "num_beams": 2,
                                                                 "decoder_start_token_id": 2, "eos_token_id": 2,
                                                                 "pad_token_id": 1, "early_stopping": True},
                        "files": {"tokenizer.json": entry("triples/tokenizer.json")},
                        "variants": {"fp32": {"files": {"decoder.onnx": entry("triples/decoder.onnx")}}}},
        },
    }
    (root / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")
    return root, manifest


def _use_manifest(models: Path) -> None:
    """What the runtime does with a manifest before it opens a model: every accessor, every file check."""
    from d2r_edge.onnx.manifest import Role, load_manifest
    from d2r_edge.onnx.seq2seq import GenerationSettings

    m = load_manifest(models)
    for role in Role:
        if not m.has(role):
            continue
        entry = m.role(role, allow_random_weights=True)
        entry.source, entry.rescore_margin
        if entry.id2label:
            [entry.id2label[i] for i in sorted(entry.id2label)]
        if "tokenizer.json" in entry.files:
            entry.tokenizer_path()
        for variant in entry.variants:
            entry.variant_paths(variant)
        if role is Role.TRIPLES:
            GenerationSettings.from_manifest(entry.generation, where=entry.where)


@FUZZ
@given(data=st.data())
def test_a_damaged_manifest_is_used_or_refused(tmp_path_factory, data):
    root, manifest = _manifest_dir(tmp_path_factory.mktemp("m"))
    path = root / "manifest.json"
    if data.draw(st.booleans()):
        path.write_text(json.dumps(data.draw(_mutated(manifest))), encoding="utf-8")
    else:
        path.write_bytes(_damage_bytes(path.read_bytes(), data.draw(_BYTE_DAMAGE)))
    try:
        _use_manifest(root)
    except D2RError as exc:
        assert _names(exc, path, root), exc


def test_an_intact_manifest_passes_every_check(tmp_path):
    root, _ = _manifest_dir(tmp_path)
    _use_manifest(root)


def test_found_manifest_paths_that_leave_the_profile_are_refused(tmp_path):
    from d2r_edge.errors import ManifestError
    from d2r_edge.onnx.manifest import load_manifest

    root, manifest = _manifest_dir(tmp_path)
    for field, value in (("directory", "../../elsewhere"), ("directory", "/abs")):
        bad = copy.deepcopy(manifest)
        bad["roles"]["nli"][field] = value
        (root / "manifest.json").write_text(json.dumps(bad))
        with pytest.raises(ManifestError, match="manifest.json role nli"):
            load_manifest(root)
    bad = copy.deepcopy(manifest)
    bad["roles"]["nli"]["files"] = {"../../../etc/passwd": {"sha256": "0", "size_bytes": 1}}
    (root / "manifest.json").write_text(json.dumps(bad))
    with pytest.raises(ManifestError, match="not a path inside"):
        load_manifest(root)


def test_found_manifest_blocks_of_other_types_are_one_manifest_error(tmp_path):
    """A list where an object belongs (roles, source, quantization, generation values) raised
    AttributeError / TypeError inside a model's constructor."""
    from d2r_edge.errors import ConfigError, ManifestError
    from d2r_edge.onnx.manifest import load_manifest

    root, manifest = _manifest_dir(tmp_path)
    for mutate in (lambda m: m.update(roles=[]), lambda m: m["roles"]["nli"].update(source="x"),
                   lambda m: m["roles"]["nli"]["variants"]["int8"].update(quantization={"fp32_rescore_margin": "a"}),
                   lambda m: m["roles"]["triples"]["generation"].update(num_beams=[2])):
        bad = copy.deepcopy(manifest)
        mutate(bad)
        (root / "manifest.json").write_text(json.dumps(bad))
        with pytest.raises(ManifestError, match="manifest.json"):
            load_manifest(root)
    bad = copy.deepcopy(manifest)
    bad["roles"]["triples"]["generation"]["num_beams"] = "2"
    (root / "manifest.json").write_text(json.dumps(bad))
    from d2r_edge.onnx.seq2seq import GenerationSettings

    with pytest.raises(ConfigError, match="num_beams='2'"):
        GenerationSettings.from_manifest(load_manifest(root).role("triples", allow_random_weights=True).generation)


# --- knowledge-base directories ----------------------------------------------------------------------

DEMO = Path(__file__).resolve().parent.parent / "d2r_edge" / "data" / "demo"


@pytest.fixture(scope="module")
def kb_and_embedder(tmp_path_factory, tiny_models):
    """The demo documents as a KB with one persisted refresh (so a delta shard exists too)."""
    from d2r_edge.eval.datasets import write_docs
    from d2r_edge.onnx.encoders import Embedder
    from d2r_edge.onnx.manifest import load_manifest
    from d2r_edge.retrieval.dense import HNSWConfig
    from d2r_edge.retrieval.docs import Document, read_documents
    from d2r_edge.retrieval.kb import KBConfig, KnowledgeBase

    root = tmp_path_factory.mktemp("kbfuzz")
    embedder = Embedder(load_manifest(tiny_models), allow_random_weights=True)
    docs = read_documents(DEMO / "docs.jsonl").documents
    cfg = KBConfig(hnsw=HNSWConfig(exact_below_chunks=0))    # an HNSW graph even for 30 chunks
    kb = KnowledgeBase.build(write_docs(docs[:-3], root / "docs.jsonl"), root / "kb", embedder, cfg)
    kb.queue(write_docs(docs[-3:] + [Document("new-1", "Fresh", "A document added by a refresh.")],
                        root / "new.jsonl"))
    kb.refresh(embedder, persist=True)
    return root / "kb", embedder


def _kb_answers(kb_dir: Path, embedder) -> list:
    from d2r_edge.retrieval.kb import KnowledgeBase
    from d2r_edge.retrieval.retriever import RetrievalConfig, Retriever

    r = Retriever(KnowledgeBase.open(kb_dir, embedder), embedder)
    return [[p.chunk_id for p in r.retrieve(q, RetrievalConfig(kind=kind, top_k=5))]
            for q in ("Where is the observatory?", "A document added by a refresh.") for kind in ("dense", "bm25")]


def _kb_files(kb_dir: Path) -> list[str]:
    return sorted(str(p.relative_to(kb_dir)) for p in kb_dir.rglob("*") if p.is_file())


@FUZZ
@given(data=st.data())
def test_a_damaged_kb_directory_opens_the_same_or_is_refused(tmp_path_factory, kb_and_embedder, data):
    from d2r_edge.retrieval.kb import KBError

    kb_dir, embedder = kb_and_embedder
    want = _kb_answers(kb_dir, embedder)
    work = tmp_path_factory.mktemp("kbcopy") / "kb"
    shutil.copytree(kb_dir, work)
    name = data.draw(st.sampled_from(_kb_files(work)))
    target = work / name
    how = data.draw(st.one_of(st.just("delete"), _BYTE_DAMAGE, st.just("mutate")))
    if how == "delete":
        target.unlink()
    elif how == "mutate" and name.endswith("manifest.json"):
        target.write_text(json.dumps(data.draw(_mutated(json.loads(target.read_text())))), encoding="utf-8")
    elif how == "mutate" and name.endswith(".jsonl"):
        lines = target.read_text(encoding="utf-8").splitlines()
        i = data.draw(st.integers(0, max(0, len(lines) - 1)))
        if lines:
            lines[i] = json.dumps(data.draw(_mutated(json.loads(lines[i]))))
        target.write_text("\n".join(lines) + "\n", encoding="utf-8")
    else:
        target.write_bytes(_damage_bytes(target.read_bytes(), "half" if how == "mutate" else how))
    try:
        got = _kb_answers(work, embedder)
    except KBError as exc:
        assert _names(exc, work, target), exc
        return
    # opened: then it must answer as the intact KB does, unless what changed is not read on open
    # (docs.jsonl, the queue) or is metadata the answers do not depend on
    if got != want:
        assert name.endswith("manifest.json") or name.endswith("chunks.jsonl"), (name, how)


def test_found_a_truncated_kb_file_is_refused_before_it_is_parsed(kb_and_embedder, tmp_path):
    """A half-written hnsw.bin reached hnswlib (RuntimeError, or worse); a chunks.jsonl line of another
    shape reached the retriever (KeyError at query time). Now: the sizes the manifest records, and
    chunk rows checked on open."""
    from d2r_edge.retrieval.kb import KBError, KnowledgeBase

    kb_dir, embedder = kb_and_embedder
    for name in ("hnsw.bin", "embeddings.npy", "bm25.npz", "chunks.jsonl", "deltas/000002/embeddings.npy"):
        work = tmp_path / name.replace("/", "_") / "kb"
        shutil.copytree(kb_dir, work)
        (work / name).write_bytes((work / name).read_bytes()[:-7])
        with pytest.raises(KBError, match="truncated or replaced"):
            KnowledgeBase.open(work, embedder)
    work = tmp_path / "rows" / "kb"
    shutil.copytree(kb_dir, work)
    lines = (work / "chunks.jsonl").read_text().splitlines()
    lines[3] = json.dumps({**json.loads(lines[3]), "text": None})
    (work / "chunks.jsonl").write_text("\n".join(lines) + "\n")
    manifest = json.loads((work / "manifest.json").read_text())
    manifest["files"].pop("chunks.jsonl")                    # so the size check does not catch it first
    (work / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(KBError, match="chunks.jsonl line 4: not a chunk record"):
        KnowledgeBase.open(work, embedder)


# --- eval answers --out folders ----------------------------------------------------------------------

_METHODS = "naive,best_fixed,linucb,oracle"
# what a record may change when its attempt was computed again: the measured cost
_MEASURED = {"latency_s", "mem_growth_mib", "memory_kind", "over_budget"}


def _eval_args(queries: Path, models: Path, out: Path) -> list[str]:
    return ["eval", "answers", "--task", "fever", "--train", str(queries), "--test", str(queries), "--train-limit",
            "8", "--test-limit", "12", "--models", str(models), "--allow-random-weights", "--out", str(out),
            "--bootstrap", "100", "--methods", _METHODS]


def _main_with_hash_nli(args: list[str]) -> int:
    """`d2r-edge ARGS` in this process with the varied stand-in NLI, so failures and repairs occur."""
    from d2r_edge.cli import main
    from d2r_edge.onnx.encoders import NLI

    real = NLI.score
    NLI.score = lambda self, pairs: hash_nli_scores(pairs)
    try:
        return main(args)
    finally:
        NLI.score = real


def _eval(args: list[str], capsys) -> tuple[int, str]:
    return _main_with_hash_nli(args), capsys.readouterr().err


def _method_records(out: Path) -> dict[str, list[dict]]:
    """Each method's records by query id (a record redone after damage is appended at the end)."""
    return {m: sorted((json.loads(line) for line in (out / "methods" / f"{m}.jsonl").read_text().splitlines()),
                      key=lambda r: r["id"]) for m in _METHODS.split(",")}


@pytest.fixture(scope="module")
def evaluated_out(tmp_path_factory, tiny_models, shared_data):
    root = tmp_path_factory.mktemp("evalfuzz")
    queries = root / "fever.jsonl"
    lines = (shared_data / "fever" / "dev.jsonl").read_text(encoding="utf-8").splitlines()[:60]
    queries.write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert _main_with_hash_nli(_eval_args(queries, tiny_models, root / "out")) == 0
    return queries, root / "out"


def _out_files(out: Path) -> list[str]:
    return sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()
                  and p.name not in ("summary.json", "report.md") and p.suffix != ".png")


@FUZZ_CLI
@given(data=st.data())
def test_a_damaged_eval_out_gives_the_same_results_or_one_clear_error(tmp_path_factory, evaluated_out, tiny_models,
                                                                      capsys, data):
    queries, src = evaluated_out
    want = _method_records(src)
    out = tmp_path_factory.mktemp("evalcopy") / "out"
    shutil.copytree(src, out)
    name = data.draw(st.sampled_from(_out_files(out)))
    target = out / name
    how = data.draw(st.sampled_from(["delete", "half", "last_byte", "garbage_line", "other_json", "drop_key"]))
    if how == "delete":
        target.unlink()
    elif how in ("half", "last_byte"):
        target.write_bytes(_damage_bytes(target.read_bytes(), how))
    else:
        lines = target.read_bytes().split(b"\n")
        i = data.draw(st.integers(0, max(0, len(lines) - 2)))
        if how == "garbage_line":
            lines.insert(i, data.draw(st.sampled_from([b"\xff\xfe", b"{", b"[" * 3000, b"\x00", b"null"])))
        elif how == "other_json":
            lines[i] = json.dumps(data.draw(_json)).encode()
        else:
            try:
                row = json.loads(lines[i])
            except ValueError:
                row = None
            if isinstance(row, dict) and row:
                row.pop(data.draw(st.sampled_from(sorted(row))))
                lines[i] = json.dumps(row).encode()
        target.write_bytes(b"\n".join(lines))
    rc, err = _eval(_eval_args(queries, tiny_models, out), capsys)
    if rc != 0:
        lines = [ln for ln in err.splitlines() if ln.startswith("d2r-edge:")]
        assert len(lines) == 1 and "Traceback" not in err, err
        assert str(out) in lines[0] or target.name in lines[0], lines[0]
        assert name == "settings.json", f"only damaged settings are refused; {name} ({how}): {lines[0]}"
        return
    got = _method_records(out)
    recomputed = name == "attempts.jsonl" or name.startswith("kb")
    for m in want:
        if recomputed and m != "naive":
            # attempts computed again carry newly measured costs, which the cost-aware policies and
            # the oracle's tie-break read: the first answers must still be the same
            assert [(r["id"], r["first_answer"]) for r in got[m]] == [(r["id"], r["first_answer"]) for r in want[m]]
            continue
        strip = (lambda r: {k: v for k, v in r.items() if k not in _MEASURED}) if recomputed else (lambda r: r)
        assert [strip(r) for r in got[m]] == [strip(r) for r in want[m]], (m, name, how)


@pytest.mark.slow
def test_files_with_more_examples(tiny_models):
    """The same properties searched 2x longer (the `slow` step; 5x under `.ci/run --full`; the eval-folder
    examples rerun the CLI)."""
    search_longer(__file__, EXAMPLES * longer(2, 5), D2R_TINY_MODELS=str(tiny_models))
