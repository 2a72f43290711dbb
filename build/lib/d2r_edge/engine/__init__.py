"""Where the work runs: this process (`local`) or a pool of Ray actors (`ray`, the `[ray]` extra).

The Ray engine never changes what is computed: every worker builds the same
pipeline from the same `RunSettings` and calls the same `answer_query`; only
who computes which query, and when its record arrives, differ.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from d2r_edge.errors import ConfigError


class Engine(str, Enum):
    LOCAL = "local"
    RAY = "ray"


@dataclass(frozen=True)
class RayConfig:
    """A Ray actor pool. `address=None` starts a Ray instance inside this process (a laptop);
    "auto" or "HOST:PORT" joins a running cluster (`ray start --head` on the head node)."""

    address: str | None = None
    workers: int = 2
    cpus_per_worker: int = 1          # Ray CPUs per actor; also its ONNX Runtime intra-op threads
    batch_queries: int = 4            # queries per task: a record is written when its batch ends
    max_batch_retries: int = 3        # a batch whose worker dies is redone on a new worker
    worker_setup: str | None = None   # "package.module:function" each worker calls before loading models

    def __post_init__(self) -> None:
        for name in ("workers", "cpus_per_worker", "batch_queries"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"RayConfig.{name} must be an integer >= 1, got {value!r}")
        if self.worker_setup is not None and self.worker_setup.count(":") != 1:
            raise ConfigError(f"RayConfig.worker_setup must be 'package.module:function', got {self.worker_setup!r}")
        if not isinstance(self.max_batch_retries, int) or self.max_batch_retries < 0:
            raise ConfigError(f"RayConfig.max_batch_retries must be an integer >= 0, got {self.max_batch_retries!r}")
