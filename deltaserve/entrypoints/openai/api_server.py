"""The OpenAI-compatible HTTP server: build_app() wires the routes over one Engine; run_server() serves it.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models[/{id}] (API key when one is set),
GET /health and GET /metrics (open). uvicorn's graceful shutdown is the drain: on SIGTERM it stops accepting,
lets every in-flight response (streams included) finish, then the lifespan stops the engine loop."""

from __future__ import annotations

import gc
import logging
import signal
import socket
import threading
import time
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from deltaserve.core.async_engine import EngineClient
from deltaserve.core.engine_process import EngineProcess, EngineThread
from deltaserve.entrypoints.openai.errors import OpenAIError, install_handlers
from deltaserve.entrypoints.openai.guard import RequestGuard
from deltaserve.entrypoints.openai.metrics import ServerMetrics
from deltaserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from deltaserve.entrypoints.openai.serving import ServerConfig, ServingContext, body_limit
from deltaserve.entrypoints.openai.serving_chat import ChatServing
from deltaserve.entrypoints.openai.serving_completions import CompletionServing

if TYPE_CHECKING:  # the server's process of an engine process needs no torch
    from deltaserve.core.engine import Engine

_ERROR = {"description": "an error in OpenAI's shape: {\"error\": {\"message\", \"type\", \"param\", \"code\"}}"}
ERROR_RESPONSES = {status: _ERROR for status in (400, 401, 404, 413, 429, 503)}
BODIES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest}


_frozen_by = 0  # servers of this process running with start-up's objects frozen (each its own thread in tests)
_frozen_lock = threading.Lock()


def _freeze_start_up() -> None:
    """What start-up made stays for the server's life: moved out of the garbage collector's reach (as vLLM's server
    does), so that its full collections, which hold the GIL and the event loop with it, walk only what requests make.
    gc.freeze acts on the whole process, so with several servers in one (tests), the first freezes and the last to
    stop (_thaw) gives the objects back."""
    global _frozen_by
    with _frozen_lock:
        _frozen_by += 1
        if _frozen_by == 1:
            gc.collect()
            gc.freeze()


def _thaw() -> None:
    global _frozen_by
    with _frozen_lock:
        _frozen_by -= 1
        if _frozen_by == 0:
            gc.unfreeze()


def build_app(engine: Engine | EngineProcess, config: ServerConfig) -> FastAPI:
    """The app over an engine process, or an engine of this process (its loop then runs in a thread)."""
    metrics = ServerMetrics(config.served_model_name)
    handle = engine if isinstance(engine, EngineProcess) else EngineThread(engine)
    async_engine = EngineClient(handle, config.max_queue, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        metrics.on_step(async_engine.info.stats)
        _freeze_start_up()
        try:
            yield
            await async_engine.shutdown()
        finally:
            ctx.close()
            _thaw()

    app = FastAPI(title="deltaserve", summary="OpenAI-compatible server for Kimi-Linear", lifespan=lifespan)
    app.state.async_engine = async_engine
    app.state.metrics = metrics
    install_handlers(app, metrics.on_error_response)
    ctx = ServingContext(async_engine, config)
    app.state.max_body_bytes = body_limit(ctx.max_model_len) if config.max_body_bytes is None else config.max_body_bytes
    app.add_middleware(RequestGuard, api_key=config.api_key, max_body_bytes=app.state.max_body_bytes,
                       on_error=metrics.on_error_response)
    _add_routes(app, ctx, CompletionServing(ctx), ChatServing(ctx), metrics, int(time.time()))
    app.openapi = lambda: _openapi(app)
    return app


def _add_routes(app: FastAPI, ctx: ServingContext, completions: CompletionServing, chat: ChatServing,
                metrics: ServerMetrics, created: int) -> None:
    model_card = {"id": ctx.config.served_model_name, "object": "model", "created": created, "owned_by": "deltaserve",
                  "max_model_len": ctx.max_model_len}

    # the bodies are read by ctx.read_body (a large one is validated off the loop); _openapi documents them
    @app.post("/v1/completions", responses=ERROR_RESPONSES)
    async def create_completion(request: Request):
        return await completions.create(await ctx.read_body(request, CompletionRequest), request)

    @app.post("/v1/chat/completions", responses=ERROR_RESPONSES)
    async def create_chat_completion(request: Request):
        return await chat.create(await ctx.read_body(request, ChatCompletionRequest), request)

    @app.get("/v1/models", responses=ERROR_RESPONSES)
    async def list_models():
        return {"object": "list", "data": [model_card]}

    @app.get("/v1/models/{model_id:path}", responses=ERROR_RESPONSES)
    async def retrieve_model(model_id: str):
        ctx.check_model(model_id)
        return model_card

    @app.get("/health", responses={503: _ERROR})
    async def health():
        if not ctx.async_engine.is_running:
            raise OpenAIError(503, "the engine loop is not running", code="unavailable")
        return JSONResponse({})

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)


def _openapi(app: FastAPI) -> dict:
    """FastAPI's schema with the request bodies that read_body validates, less the 422 FastAPI documents for every
    route: validation errors are 400 here."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for path, model in BODIES.items():
            body = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(body.pop("$defs", {}))
            components[model.__name__] = body
            schema["paths"][path]["post"]["requestBody"] = {
                "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}},
                "required": True}
        for path in schema["paths"].values():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
        app.openapi_schema = schema
    return app.openapi_schema


def run_server(engine: Engine | EngineProcess, config: ServerConfig, sock: socket.socket, drain_timeout: float | None,
               log_level: str = "info") -> None:
    """Serve on sock (bound: command.bind_address) until SIGINT/SIGTERM; then drain (at most drain_timeout
    seconds) and return normally."""
    import uvicorn

    host, port = sock.getsockname()[:2]

    class Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started:  # uvicorn says where it listens only for a socket it bound itself
                address = f"[{host}]" if ":" in host else host
                logging.getLogger("uvicorn.error").info("Uvicorn running on http://%s:%d (Press CTRL+C to quit)",
                                                        address, port)

    server = Server(uvicorn.Config(build_app(engine, config), host=host, port=port, log_level=log_level,
                                   timeout_graceful_shutdown=drain_timeout))
    # uvicorn re-raises the signal after its graceful shutdown, into the handler that was there before it:
    # a no-op for SIGTERM, so that a drained server exits 0 (SIGINT still ends as KeyboardInterrupt, 130)
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        server.run(sockets=[sock])
    finally:
        signal.signal(signal.SIGTERM, previous)
    if not server.started:  # uvicorn before 0.30 returns here when the app's start-up failed (later ones exit)
        raise RuntimeError("the server did not start; its log above says why")
