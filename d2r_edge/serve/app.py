"""The HTTP layer over one `Runtime` (Starlette): routes, auth, limits, errors, records, metrics.

The runtime knows nothing of HTTP; here requests become `Runtime.answer` / `verify` calls run
off the event loop, and errors become OpenAI-style error bodies with a status:
400 bad input (naming the field), 401 no/wrong key, 404/405 unknown route or method, 413 body
too large, 429 over `max_concurrency` (with Retry-After), 502 generator failed, 504 generator
timed out, 503 shutting down, 500 anything else (logged here with its traceback; the client
gets one line, never a trace). Request bodies and keys are never logged.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import anyio
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

import d2r_edge.serve.openai_api as api
from d2r_edge.deadline import DeadlineExceeded
from d2r_edge.errors import ConfigError, D2RError, InputError
from d2r_edge.generate.openai_compat import GeneratorError
from d2r_edge.jsonl import loads as json_loads
from d2r_edge.onnx.sharing import MicroBatcher
from d2r_edge.redact import redact, register_secret
from d2r_edge.runner import RecordLog, run_record_ok
from d2r_edge.runtime import Result, Runtime
from d2r_edge.serve.metrics import Metrics
from d2r_edge.serve.ui import Ui, ui_cards, ui_login, ui_page

log = logging.getLogger(__name__)

DEADLINE_HEADER = "x-d2r-deadline-ms"


@dataclass(frozen=True)
class ServeConfig:
    """How the server runs; the runtime's own settings are `RunSettings`."""

    records_path: Path | None = None        # one JSONL record per answered request (the run schema + request_id)
    learn: bool = False                     # Alg. 2's label-free update after each repair
    policy_path: Path | None = None         # where --learn checkpoints the policy
    checkpoint_every_updates: int = 50
    api_key_env: str | None = None          # every route but /healthz needs "Authorization: Bearer $NAME"
    max_concurrency: int = 16               # requests admitted at once (running or queued); more -> 429
    max_body_bytes: int = 1 << 20
    model_name: str = api.MODEL_NAME
    ui: bool = False                        # GET /ui: the last `ui_keep` answered requests as report cards
    ui_keep: int = 200

    def __post_init__(self) -> None:
        for name in ("checkpoint_every_updates", "max_concurrency", "max_body_bytes", "ui_keep"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be an int >= 1, got {value!r}")
        if self.learn and self.policy_path is None:
            raise ConfigError("--learn updates the policy online and checkpoints it: give --policy FILE.npz")
        if self.api_key_env is not None and not os.environ.get(self.api_key_env):
            raise ConfigError(f"--api-key-env {self.api_key_env}: that environment variable is not set or empty; "
                              f"export it with the key clients must send, or leave the flag out (no auth)")

    def api_key(self) -> str | None:
        key = os.environ.get(self.api_key_env) if self.api_key_env else None
        register_secret(key)       # masked in any log line or error text that would quote it
        return key


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None,
                 headers: dict | None = None, extra: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.code, self.headers = status, message, kind, code, headers
        self.extra = extra or {}


def _error_response(err: ApiError) -> JSONResponse:
    body = api.error_body(redact(err.message), err.kind, err.code)
    body["error"].update(err.extra)
    return JSONResponse(body, status_code=err.status, headers=err.headers)


class Server:
    """The glue: admission, records, checkpoints and metrics around one Runtime."""

    def __init__(self, runtime: Runtime, config: ServeConfig) -> None:
        self.runtime, self.config = runtime, config
        self.metrics = Metrics()
        self.in_flight = 0
        self.draining = False
        self._records_lock = threading.Lock()
        self._pending_updates = 0
        self.records = None
        self.ui = Ui(config.api_key(), config.ui_keep, config.records_path) if config.ui else None
        batcher = _find(runtime.pipeline.diagnoser.nli, MicroBatcher)
        if batcher is not None:
            batcher.on_batch = self.metrics.batch_pairs.observe
        if config.records_path is not None:
            self.records = RecordLog(config.records_path, valid=run_record_ok, keep=False, slim=_logged_update)
            if config.learn:
                replayed = runtime.replay(self.records.records)
                if replayed:
                    log.info("replayed %d logged policy update(s) the checkpoint lacked", replayed)
                    runtime.save_policy(config.policy_path)
            self.records.records = []

    # --- work run in a worker thread -------------------------------------------------------
    def answer(self, question: str, deadline_s: float | None) -> Result:
        res = self.runtime.answer(question, deadline_s=deadline_s, learn=self.config.learn)
        if self.records is not None:
            with self._records_lock:
                self.records.append(res.record)
        if self.ui is not None:
            self.ui.add(res.record)
        if self.config.learn and res.repaired:
            self.metrics.policy_updates.inc()
            with self._records_lock:
                self._pending_updates += 1
                due = self._pending_updates >= self.config.checkpoint_every_updates
                if due:
                    self._pending_updates = 0
            if due:
                self.runtime.save_policy(self.config.policy_path)
        self.metrics.observe(res)
        return res

    def shutdown(self) -> None:
        self.draining = True
        if self.config.learn:
            self.runtime.save_policy(self.config.policy_path)
            log.info("policy checkpointed to %s", self.config.policy_path)
        if self.records is not None:
            self.records.close()

    # --- admission -------------------------------------------------------------------------
    def admit(self) -> None:
        if self.draining:
            raise ApiError(503, "the server is shutting down; retry on another instance", "server_error",
                           "shutting_down")
        if self.in_flight >= self.config.max_concurrency:
            raise ApiError(429, f"over the concurrency limit ({self.config.max_concurrency} requests at once); "
                                f"retry shortly", "rate_limit_error", "too_many_requests", {"Retry-After": "1"})
        self.in_flight += 1
        self.metrics.in_flight.set(self.in_flight)

    def release(self) -> None:
        self.in_flight -= 1
        self.metrics.in_flight.set(self.in_flight)


def _find(model, kind):
    """The `kind` wrapper in a chain of NLI wrappers (PairCache -> MicroBatcher -> NLI), or None."""
    for _ in range(8):
        if isinstance(model, kind):
            return model
        model = model.__dict__.get("inner")
        if model is None:
            return None
    return None


def _logged_update(rec: dict):
    """From each record on open, only a learned update (replayed if the checkpoint lacks it)."""
    rep = rec.get("repair")
    return rep if isinstance(rep, dict) and rep.get("x") is not None and "policy_updates" in rep else None


async def _json_body(request: Request, limit: int):
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body over {limit} bytes", code="body_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"request body over {limit} bytes", code="body_too_large")
        chunks.append(chunk)
    try:
        return json_loads(b"".join(chunks))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON ({getattr(exc, 'msg', 'not UTF-8')})",
                       code="invalid_json") from None


def _deadline_s(request: Request) -> float | None:
    raw = request.headers.get(DEADLINE_HEADER)
    if raw is None:
        return None
    try:
        ms = float(raw)
    except ValueError:
        ms = float("nan")
    if not (ms > 0 and ms < 86_400_000):
        raise ApiError(400, f"header X-D2R-Deadline-Ms must be milliseconds > 0, got {raw[:40]!r}",
                       code="invalid_deadline")
    return ms / 1000.0


def _upstream_error(exc: GeneratorError) -> ApiError:
    """502/504 naming the upstream's URL and HTTP status: GeneratorError's message is built from
    those alone (never the upstream's body, which the client log keeps redacted)."""
    extra = {"upstream_status": exc.status, "upstream_attempts": exc.attempts}
    if exc.timed_out:
        return ApiError(504, f"the generator timed out: {exc}", "upstream_error", "upstream_timeout", extra=extra)
    return ApiError(502, f"the generator failed: {exc}", "upstream_error", "upstream_error", extra=extra)


def create_app(runtime: Runtime, config: ServeConfig = ServeConfig()) -> Starlette:
    server = Server(runtime, config)

    def route(name: str, admitted: bool = True):
        """Errors -> OpenAI error bodies, requests counted by status; admission where it runs models."""
        def wrap(handler):
            async def endpoint(request: Request) -> Response:
                status = 500
                entered = False
                t0 = time.perf_counter()
                try:
                    if admitted:
                        server.admit()
                        entered = True
                    response = await handler(request)
                    status = response.status_code
                    return response
                except ApiError as err:
                    status = err.status
                    return _error_response(err)
                except InputError as exc:
                    status = 400
                    return _error_response(ApiError(400, str(exc), code="invalid_value"))
                except GeneratorError as exc:
                    err = _upstream_error(exc)
                    status = err.status
                    return _error_response(err)
                except DeadlineExceeded as exc:
                    status = 504
                    return _error_response(ApiError(504, str(exc), "server_error", "deadline_exceeded"))
                except D2RError as exc:
                    log.error("%s failed: %s: %s", name, type(exc).__name__, exc)
                    return _error_response(ApiError(500, f"{type(exc).__name__}: {exc}", "server_error",
                                                    "d2r_error"))
                except Exception:
                    log.exception("%s: internal error", name)
                    return _error_response(ApiError(500, "internal error in d2r-edge (see the server log)",
                                                    "server_error", "internal_error"))
                finally:
                    if entered:
                        server.release()
                    server.metrics.requests.labels(name, str(status)).inc()
                    log.debug("%s %d %.1f ms", name, status, 1000 * (time.perf_counter() - t0))
            return endpoint
        return wrap

    @route("chat_completions")
    async def chat(request: Request) -> Response:
        req = api.parse_chat(await _json_body(request, config.max_body_bytes))
        deadline = _deadline_s(request)
        res = await anyio.to_thread.run_sync(server.answer, req.question, deadline)
        d2r = api.d2r_object(res, runtime.pipeline.budget, deadline)
        model = req.model or config.model_name
        if req.stream:
            chunks = list(api.stream_chunks(res, model, d2r, req.include_usage))

            async def body():
                for chunk in chunks:
                    yield chunk
            return StreamingResponse(body(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return JSONResponse(api.completion(res, model, d2r))

    @route("verify")
    async def verify(request: Request) -> Response:
        req = api.parse_verify(await _json_body(request, config.max_body_bytes))
        v = await anyio.to_thread.run_sync(
            lambda: runtime.verify(req.question, req.answer, req.passages, req.label))
        return JSONResponse(api.verification_object(v))

    @route("models", admitted=False)
    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": config.model_name, "object": "model", "created": 0, "owned_by": "d2r-edge"}]})

    @route("healthz", admitted=False)
    async def healthz(request: Request) -> Response:
        if server.draining:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        kb = getattr(runtime.pipeline.retriever, "kb", None)
        return JSONResponse({"status": "ok", "task": runtime.task.value,
                             "kb_docs": len(kb.doc_ids) if kb is not None else None,
                             "learn": config.learn, "in_flight": server.in_flight})

    @route("metrics", admitted=False)
    async def metrics(request: Request) -> Response:
        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @route("ui", admitted=False)
    async def ui_index(request: Request) -> Response:
        return await ui_page(server.ui, request)

    @route("ui_cards", admitted=False)
    async def ui_data(request: Request) -> Response:
        return await ui_cards(server.ui, request)

    @route("ui_login", admitted=False)
    async def ui_sign_in(request: Request) -> Response:
        return await ui_login(server.ui, request)

    async def not_found(request: Request, exc: HTTPException) -> Response:
        server.metrics.requests.labels("other", str(exc.status_code)).inc()
        return _error_response(ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                                        code="not_found" if exc.status_code == 404 else "method_not_allowed"))

    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app):
        yield
        server.shutdown()

    app = Starlette(routes=[
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/verify", verify, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        *([Route("/ui", ui_index, methods=["GET"]), Route("/ui/cards.json", ui_data, methods=["GET"]),
           Route("/ui/login", ui_sign_in, methods=["POST"])] if config.ui else []),
    ], exception_handlers={HTTPException: not_found}, lifespan=lifespan)
    app.state.server = server
    key = config.api_key()
    return BearerAuth(app, key, UI_PATHS if config.ui else ()) if key else app


UI_PATHS = ("/ui", "/ui/cards.json", "/ui/login")     # they check the key or a session cookie themselves


class BearerAuth:
    """ASGI middleware: every route but /healthz (and serve --ui's pages) needs `Authorization: Bearer <key>`."""

    def __init__(self, app, key: str, own_auth: tuple[str, ...] = ()) -> None:
        self.app, self._key = app, key.encode("utf-8")
        self.state = getattr(app, "state", None)
        self._open = {"/healthz", *own_auth}

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope.get("path") not in self._open:
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            scheme, _, token = given.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self._key):
                err = ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                               "invalid_request_error", "invalid_api_key", {"WWW-Authenticate": "Bearer"})
                await _error_response(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)
