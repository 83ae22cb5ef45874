"""The HTTP face of one replica: the FastAPI app `vllm serve` builds, on our engine.

Every route, middleware (API key, CORS), frontend option (chat template, tool-call and
reasoning parsers...) and error body is vLLM's own: `build_app` + `init_app_state`, as
`vllm serve` calls them, so a new vLLM route comes for free. What this module changes:
- `/health` (engine + handshake), `/metrics` (vLLM's and the Spyre KV figures) and
  `/spyre/status` are ours;
- `/v1/completions` and `/v1/chat/completions` call vLLM's own serving objects but refuse
  unknown request fields (vLLM ignores them) and can coalesce streamed chunks;
- options that belong to uvicorn/the socket are Ray Serve's (http_options), not ours.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import secrets
import types
from http import HTTPStatus
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.launchers.api_server.app_state import init_app_state
from vllm.entrypoints.launchers.app import build_app
from vllm.entrypoints.launchers.cli_args import (
    FrontendArgs,
    make_arg_parser,
    validate_parsed_serve_args,
)
from vllm.entrypoints.launchers.launcher import validate_api_server_args
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.entrypoints.serve.engine.protocol import ErrorInfo, ErrorResponse
from vllm.entrypoints.serve.utils.api_utils import validate_json_request, with_cancellation
from vllm.reasoning import ReasoningParserManager
from vllm.tool_parsers import ToolParserManager
from vllm.utils.argparse_utils import FlexibleArgumentParser

from spyre_serve import vllm_compat
from spyre_serve.serve.metrics import PROMETHEUS_CONTENT_TYPE

# The serving hooks this module imports above, checked once per replica process.
vllm_compat.check_once(vllm_compat.SERVING)

# Routes of vLLM's app that this module serves itself (see the module doc).
OWN_ROUTES = {"/health", "/metrics", "/v1/completions", "/v1/chat/completions"}

_END = object()


async def coalesce(chunks: AsyncIterator[str], interval_s: float) -> AsyncIterator[str]:
    """Join the SSE chunks that arrive within `interval_s` into one write; 0 passes each on.

    A timer flushes, not the next chunk: a slow token never waits for the one after it.
    Closing this generator closes `chunks` at once, which aborts the request in the engine.
    """
    if interval_s <= 0:
        try:
            async for chunk in chunks:
                yield chunk
        finally:
            await chunks.aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump():
        try:
            async for chunk in chunks:
                await queue.put(chunk)
        except Exception as e:  # handed to the consumer, which re-raises it in the response
            await queue.put(e)
        await queue.put(_END)

    pumping = asyncio.create_task(pump())
    loop = asyncio.get_running_loop()
    try:
        ended = False
        while not ended:
            item = await queue.get()
            if item is _END:
                return
            batch, deadline = [item], loop.time() + interval_s
            while (left := deadline - loop.time()) > 0:
                try:
                    item = await asyncio.wait_for(queue.get(), left)
                except TimeoutError:
                    break
                if item is _END:
                    ended = True
                    break
                batch.append(item)
            for failure in (x for x in batch if isinstance(x, Exception)):
                raise failure
            yield "".join(batch)
    finally:
        pumping.cancel()
        await asyncio.gather(pumping, return_exceptions=True)
        await chunks.aclose()


class ClosingStreamingResponse(StreamingResponse):
    """A stream whose body is closed however the response ends.

    When a client hangs up, Starlette cancels the stream wherever it waits. If that is in
    `send`, the body generator is left open and vLLM aborts the request only once the
    garbage collector finalizes it (its generate() says so), by which time a long request
    may have run to its end. Closing the body here aborts it at the hang-up.
    """

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


def openai_error(message: str, status_code: int, err_type: str) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=err_type, code=status_code))
    return JSONResponse(body.model_dump(), status_code=status_code)


def unknown_fields_error(request: BaseModel) -> Response | None:
    """vLLM's request models keep unknown fields and ignore them; OpenAI's API refuses them,
    and a misspelt sampling parameter silently ignored is worse than an error."""
    extra = sorted(request.model_extra or {})
    if not extra:
        return None
    return openai_error(f"Unrecognized request argument supplied: {', '.join(extra)}", 400,
                        "BadRequestError")


def serve_namespace(engine_kwargs: dict[str, Any], frontend_kwargs: dict[str, Any],
                    engine=None) -> argparse.Namespace:
    """The namespace `vllm serve` would have parsed for these engine and frontend options,
    validated as `vllm serve` validates it (unknown parser, auto tool choice without one...).
    """
    namespace = make_arg_parser(FlexibleArgumentParser()).parse_args([])
    for source, cls in ((FrontendArgs(**frontend_kwargs), FrontendArgs),
                        (AsyncEngineArgs(**engine_kwargs), AsyncEngineArgs)):
        for field in dataclasses.fields(cls):
            setattr(namespace, field.name, getattr(source, field.name))
    if engine is not None:
        # As in `vllm serve`: the very config the engine resolved (model defaults land on it).
        namespace.structured_outputs_config = engine.vllm_config.structured_outputs_config
    validate_parsed_serve_args(namespace)
    for plugin, manager in ((namespace.tool_parser_plugin, ToolParserManager.import_tool_parser),
                            (namespace.reasoning_parser_plugin,
                             ReasoningParserManager.import_reasoning_parser)):
        if plugin and len(plugin) > 3:  # `vllm serve`'s own rule
            manager(plugin)
    validate_api_server_args(namespace)
    return namespace


def api_keys(namespace: argparse.Namespace) -> list[str]:
    """The keys vLLM's AuthenticationMiddleware checks: --api-key, else VLLM_API_KEY."""
    keys = namespace.api_key or [os.environ.get("VLLM_API_KEY")]
    return [k for k in (keys if isinstance(keys, list) else [keys]) if k]


async def build_openai_app(engine, engine_kwargs: dict[str, Any],
                           frontend_kwargs: dict[str, Any], *,
                           status: Callable[[], Awaitable[dict]],
                           metrics: Callable[[], bytes], replica_id: str,
                           stream_batching_interval_s: float = 0.0) -> FastAPI:
    args = serve_namespace(engine_kwargs, frontend_kwargs, engine)
    tasks = await engine.get_supported_tasks()
    app = build_app(args, tasks, engine.model_config)
    await init_app_state(engine, app.state, args, supported_tasks=tasks)
    app.router.routes[:] = [r for r in app.router.routes
                            if getattr(r, "path", None) not in OWN_ROUTES]
    left = [r for r in app.router.routes if not hasattr(r, "path")]
    if left:  # FastAPI >= 0.137 keeps lazy routers without a path: the filter would miss
        raise vllm_compat.CompatError(f"routes without a path in vLLM's app: {left}; "
                                      "pin fastapi<0.137 or port OWN_ROUTES filtering")
    # Every response of ours names the replica that made it (`x-spyre-replica`), so a
    # client, a log or a test can tell which replica served it. Per response, not as ASGI
    # middleware: wrapping `send` kept Serve from aborting requests whose client hung up.
    tag = {"x-spyre-replica": replica_id}
    # vLLM's engine-error handler asks a uvicorn server to exit; here Serve's health check
    # replaces a dead replica instead, but the handler still needs something to set.
    app.state.server = types.SimpleNamespace(should_exit=False)
    keys = api_keys(args)

    def key_refused(request: Request) -> Response | None:
        """/spyre/status shows paths and placement groups: same key as the /v1 routes."""
        given = request.headers.get("authorization", "")
        if keys and not any(secrets.compare_digest(given, f"Bearer {k}") for k in keys):
            return openai_error("Unauthorized: a valid API key is required", 401,
                                "AuthenticationError")
        return None

    @app.exception_handler(StarletteHTTPException)
    async def framework_error(_, exc: StarletteHTTPException):
        # Starlette's own errors (unknown route, wrong method, unreadable body) in OpenAI's shape.
        name = HTTPStatus(exc.status_code).phrase.replace(" ", "") + "Error"
        return openai_error(str(exc.detail), exc.status_code, name)

    # build_app has already built the middleware stack (vLLM's instrumentator does), and
    # Starlette reads exception handlers only when it builds it: rebuild at first request.
    app.middleware_stack = None

    state = app.state

    def respond(result) -> Response:
        if isinstance(result, ErrorResponse):
            return JSONResponse(result.model_dump(), status_code=result.error.code, headers=tag)
        if isinstance(result, BaseModel):
            return JSONResponse(result.model_dump(), headers=tag)
        return ClosingStreamingResponse(coalesce(result, stream_batching_interval_s),
                                        media_type="text/event-stream", headers=tag)

    @app.post("/v1/completions", dependencies=[Depends(validate_json_request)])
    @with_cancellation
    async def create_completion(request: CompletionRequest, raw_request: Request):
        if refused := unknown_fields_error(request):
            return refused
        return respond(await state.openai_serving_completion.create_completion(request, raw_request))

    @app.post("/v1/chat/completions", dependencies=[Depends(validate_json_request)])
    @with_cancellation
    async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request):
        if refused := unknown_fields_error(request):
            return refused
        return respond(await state.openai_serving_chat.create_chat_completion(request, raw_request))

    @app.get("/health")
    async def health():
        try:
            await engine.check_health()
        except Exception as e:
            response = openai_error(f"engine is not running: {e}", 503,
                                    "ServiceUnavailableError")
            response.headers.update(tag)
            return response
        return JSONResponse({"status": "ok"}, headers=tag)

    @app.get("/spyre/status")
    async def spyre_status(request: Request):
        if refused := key_refused(request):
            return refused
        return JSONResponse(_jsonable(await status()), headers=tag)

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics(), media_type=PROMETHEUS_CONTENT_TYPE)

    return app


def _jsonable(value):
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _jsonable(dataclasses.asdict(value))
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value
