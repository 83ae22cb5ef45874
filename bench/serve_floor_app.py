"""A Ray Serve app with no model, for bench/serve_floor.py: what Ray and Serve cost alone.

It answers the three routes the bench uses the way an OpenAI server does: `/v1/models`,
`/metrics` (empty), and a streamed `/v1/completions` whose chunks each carry the running
`completion_tokens` count, as vLLM's do with `continuous_usage_stats`. Each chunk is made
at once (no engine, no sampling), so the tokens/s a client sees is the ceiling of Ray
Serve's own path on this machine: HTTP proxy, proxy to replica, replica back to the client.
"""
from __future__ import annotations

import asyncio
import json

from ray import serve
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse


@serve.deployment(max_ongoing_requests=64)
class NoModel:
    def __init__(self, model: str):
        self.model = model

    async def __call__(self, request: Request):
        path = request.url.path.rstrip("/")
        if path.endswith("/v1/models"):
            return JSONResponse({"object": "list", "data": [{"id": self.model, "object": "model"}]})
        if path.endswith("/metrics"):
            return PlainTextResponse("")
        if path.endswith("/v1/completions") and request.method == "POST":
            body = await request.json()
            return StreamingResponse(self.chunks(int(body["max_tokens"]), len(body["prompt"])),
                                     media_type="text/event-stream")
        return JSONResponse({"error": {"message": f"no route {path}", "type": "NotFound"}},
                            status_code=404)

    async def chunks(self, tokens: int, prompt_tokens: int):
        for i in range(1, tokens + 1):
            chunk = {"object": "text_completion", "model": self.model,
                     "choices": [{"index": 0, "text": " x", "finish_reason": None}],
                     "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": i,
                               "total_tokens": prompt_tokens + i}}
            yield f"data: {json.dumps(chunk)}\n\n"
            await asyncio.sleep(0)  # one chunk per message, as an engine's steps make them
        yield "data: [DONE]\n\n"


def build(args: dict):
    return NoModel.bind(args.get("model", "no-model"))
