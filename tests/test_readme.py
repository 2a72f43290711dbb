"""The README's "use it on your own data" commands and its Python block, run as written.

Run on the `tiny` profile (built by the session fixture) instead of `models/offline-quick`, which a
clean clone does not have before the demo builds it: the only change to each command is that
profile's path plus `--allow-random-weights` (Python: `allow_random_weights=True`). Repository
paths become absolute so the commands run in a scratch directory.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from d2r_edge.signals import FailureType

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _own_data_commands() -> list[str]:
    block = re.search(r"<!-- own-data:.*?-->\s*```bash\n(.*?)```\s*<!-- /own-data -->", README, re.S)
    assert block, "the README lost its tested own-data block"
    return [c.strip() for c in block.group(1).replace("\\\n", " ").splitlines() if c.strip()]


def _python_block() -> str:
    block = re.search(r"## Python\s*```python\n(.*?)```", README, re.S)
    assert block, "the README lost its Python block"
    return block.group(1)


def _localize(text: str, tiny: Path, shared: Path) -> str:
    return (text.replace("models/offline-quick", str(tiny))
            .replace("d2r_edge/data/demo", str(ROOT / "d2r_edge/data/demo"))
            .replace("../shared/data", str(shared)))


def test_readme_own_data_commands_and_python_run_as_written(tiny_models, shared_data, tmp_path):
    commands = _own_data_commands()
    assert [c.split()[1] for c in commands] == ["index", "run", "train", "run", "eval"]
    exe = Path(sys.executable).with_name("d2r-edge")
    if not exe.is_file():
        pytest.skip("needs the d2r-edge entry point beside this python (pip install -e .)")
    for cmd in commands:
        argv = shlex.split(_localize(cmd, tiny_models, shared_data))
        assert argv[0] == "d2r-edge"
        done = subprocess.run([str(exe), *argv[1:], "--allow-random-weights"], cwd=tmp_path,
                              capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, (cmd, done.stderr[-2000:])
    assert (tmp_path / "my-run.jsonl").is_file() and (tmp_path / "my-policy.npz").is_file()
    assert (tmp_path / "my-eval" / "report.md").is_file()
    code = _localize(_python_block(), tiny_models, shared_data).replace(
        "RunSettings(", "RunSettings(allow_random_weights=True, ", 1)
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    first, check = done.stdout.splitlines()[:2]
    assert first.startswith(("SUPPORTS", "REFUTES", "NOT ENOUGH INFO", "UNVERIFIED")), done.stdout
    assert check.split()[0] in {f.value for f in FailureType}, done.stdout


def test_readme_links_resolve_and_stays_short():
    assert len(README.splitlines()) <= 250
    for link in re.findall(r"\]\(((?!http)[^)#]+)", README):
        assert (ROOT / link).exists(), link
