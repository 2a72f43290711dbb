"""`python -m benchmarks.rss nli|rebel MODELS_DIR HOW`: peak RSS (MiB) of one approach, fresh process."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path


def main() -> None:
    warnings.filterwarnings("ignore")
    kind, models_dir, how = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    from benchmarks import bench_onnx as b

    if kind == "nli":
        b.make_nli_fn(models_dir, how)(b.diagnosis_pairs())
    else:
        b.make_rebel_fn(models_dir, how, 64 if "large" in str(models_dir) else 24)(b.rebel_texts())
    print(vm_hwm_mib())


def vm_hwm_mib() -> float:
    """This process's peak RSS. (ru_maxrss would also count the parent's peak:
    Linux keeps it across fork + exec, so a big pytest parent would leak in.)"""
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


if __name__ == "__main__":
    main()
