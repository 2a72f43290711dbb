"""`d2r-edge serve`: an OpenAI-compatible endpoint over one `Runtime` (the [serve] extra).

Point an application's `base_url` at it instead of at the LLM: every answer comes back
retrieved, checked and, where the diagnosis says so, repaired, with the diagnosis in a `d2r`
object beside the standard fields. See `app.py` for routes and status codes.
"""

from __future__ import annotations

import importlib.util
import logging
import signal
import socket

from d2r_edge.errors import MissingExtraError

log = logging.getLogger(__name__)

SERVE_PIP = "pip install 'd2r-edge[serve]'"


def _require_extra() -> None:
    for name in ("starlette", "uvicorn", "prometheus_client", "anyio"):
        if importlib.util.find_spec(name) is None:
            raise MissingExtraError("serve", name, SERVE_PIP)


def __getattr__(name: str):
    # ServeConfig / create_app import starlette: only when asked for, with the pip command if missing
    if name in ("ServeConfig", "create_app"):
        _require_extra()
        from d2r_edge.serve import app

        return getattr(app, name)
    raise AttributeError(name)


def listening_socket(host: str, port: int) -> socket.socket:
    """The bound socket uvicorn serves on; OSError (port taken, no such address) -> one CLI line.

    Made with proto IPPROTO_TCP: asyncio sets TCP_NODELAY only on connections of such a socket, and
    without it a keep-alive client (the openai SDK) waits out a delayed ACK, ~40 ms, on every
    response (uvicorn writes headers and body apart; measured 44 ms -> 1 ms per loopback call)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def serve(settings, config, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Load the runtime (models, KB, policy: errors surface here, before anything listens), bind,
    and serve until SIGINT/SIGTERM (then in-flight requests finish and, with learning on, the
    policy is checkpointed)."""
    _require_extra()
    import uvicorn

    from d2r_edge.runtime import Runtime
    from d2r_edge.serve.app import create_app

    app = create_app(Runtime(settings), config)
    sock = listening_socket(host, port)
    logging.getLogger("uvicorn").setLevel(logging.INFO)
    logging.getLogger("uvicorn.access").setLevel(logging.WARNING)   # paths only, but one line per call
    log.info("d2r-edge serving task %s on http://%s:%d (OpenAI API at /v1)", settings.task.value, host,
             sock.getsockname()[1])
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, lifespan="on", timeout_graceful_shutdown=30))
    # uvicorn drains on SIGINT/SIGTERM, then raises the signal again for the handler it found: with
    # the default one the process would die by the signal (-15), which a supervisor reads as a crash.
    # Found handlers that only note it make a clean drain return here, and the CLI exit 0.
    def noted(sig: int, frame) -> None:     # also a signal before uvicorn took over: stop, not ignore
        server.should_exit = True
        log.info("stopped by %s after draining in-flight requests", signal.Signals(sig).name)

    found = {sig: signal.signal(sig, noted) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run(sockets=[sock])
    finally:
        for sig, handler in found.items():
            signal.signal(sig, handler)
