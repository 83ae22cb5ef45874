"""The HTTP face of one replica: vLLM's OpenAI serving code behind a FastAPI app.

Request schemas, validation, sampling, chat templates and error bodies are vLLM's own
(the same objects `vllm serve` builds); this module only adds the routes, the optional
stream coalescing, and the Spyre endpoints.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import types
from http import HTTPStatus
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.launchers.api_server.app_state import init_app_state
from vllm.entrypoints.launchers.cli_args import FrontendArgs
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.entrypoints.serve.engine.protocol import ErrorInfo, ErrorResponse
from vllm.entrypoints.serve.exception_handling.register import init_exception_handler
from vllm.entrypoints.serve.utils.api_utils import validate_json_request, with_cancellation

from spyre_serve import vllm_compat
from spyre_serve.serving_metrics import PROMETHEUS_CONTENT_TYPE

# The serving hooks this module imports above, checked once per replica process.
vllm_compat.check_once(vllm_compat.SERVING)

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


def vllm_frontend_args(engine_kwargs: dict[str, Any]) -> argparse.Namespace:
    """The flat namespace `vllm serve` would have parsed for these engine kwargs."""
    engine_args = AsyncEngineArgs(**engine_kwargs)
    return argparse.Namespace(**(vars(FrontendArgs()) | vars(engine_args)))


async def build_openai_app(engine, engine_kwargs: dict[str, Any], *,
                           status: Callable[[], Awaitable[dict]],
                           metrics: Callable[[], bytes], replica_id: str,
                           stream_batching_interval_s: float = 0.0) -> FastAPI:
    app = FastAPI(title="spyre_serve", docs_url=None, redoc_url=None)
    # Every response of ours names the replica that made it (`x-spyre-replica`), so a
    # client, a log or a test can tell which replica served it. Per response, not as ASGI
    # middleware: wrapping `send` kept Serve from aborting requests whose client hung up.
    tag = {"x-spyre-replica": replica_id}
    await init_app_state(engine, app.state, vllm_frontend_args(engine_kwargs),
                         supported_tasks=await engine.get_supported_tasks())
    # vLLM's engine-error handler asks a uvicorn server to exit; here Serve's health check
    # replaces a dead replica instead, but the handler still needs something to set.
    app.state.server = types.SimpleNamespace()
    init_exception_handler(app)

    @app.exception_handler(StarletteHTTPException)
    async def framework_error(_, exc: StarletteHTTPException):
        # Starlette's own errors (unknown route, wrong method, unreadable body) in OpenAI's shape.
        name = HTTPStatus(exc.status_code).phrase.replace(" ", "") + "Error"
        return openai_error(str(exc.detail), exc.status_code, name)

    state = app.state

    def respond(result) -> Response:
        if isinstance(result, ErrorResponse):
            return JSONResponse(result.model_dump(), status_code=result.error.code, headers=tag)
        if isinstance(result, BaseModel):
            return JSONResponse(result.model_dump(), headers=tag)
        return ClosingStreamingResponse(coalesce(result, stream_batching_interval_s),
                                 media_type="text/event-stream", headers=tag)

    @app.get("/v1/models")
    async def list_models():
        return JSONResponse((await state.openai_serving_models.show_available_models()).model_dump())

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
    async def spyre_status():
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
