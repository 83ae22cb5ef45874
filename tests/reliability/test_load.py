"""Load: 200 requests at concurrency 32, half streamed, on one replica that must preempt.

50 distinct prompts, each sent 4 times (twice streamed) in a shuffled order.

Every request completes with the text a one-at-a-time run of the same prompt gives
(greedy), none is lost or duplicated (client side: one answer per request, distinct ids;
server side: the engine finished exactly 200 and generated exactly 200 x max_tokens), vLLM
did preempt, and afterwards every KV block is free again.
"""
from __future__ import annotations

import asyncio
import random
import threading
import time

from .helpers import (SHARED_BLOCKS, SHARED_MAX_NUM_SEQS, completion_body, metric, record,
                      sse_events, wait_for)
import pytest

pytestmark = pytest.mark.slow

PROMPTS = 50           # distinct prompts; each is sent 4 times, twice streamed, twice not
REQUESTS = 4 * PROMPTS
CONCURRENCY = 32
MAX_TOKENS = 48        # with a 30-60 token prompt: 2 blocks of 64 per sequence
REQUEST_TIMEOUT_S = 180
LOAD_TIMEOUT_S = 900  # the whole concurrent phase: a hang fails here, with the counts


def prompt(i: int) -> str:
    words = " ".join(f"w{(i * 13 + j * 7) % 101}" for j in range(8 + i % 12))
    return f"load request {i}: {words}"


async def send(client, i: int, stream: bool) -> dict:
    body = completion_body(prompt(i), MAX_TOKENS, stream=stream)
    if not stream:
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        data = r.json()
        return {"id": data["id"], "text": data["choices"][0]["text"],
                "finish_reason": data["choices"][0]["finish_reason"],
                "tokens": data["usage"]["completion_tokens"]}
    body["stream_options"] = {"include_usage": True}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        events = sse_events([line async for line in r.aiter_lines()])
    text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
    finish = [e["choices"][0]["finish_reason"] for e in events
              if e["choices"] and e["choices"][0]["finish_reason"]]
    usage = [e["usage"] for e in events if e.get("usage")]
    ids = {e["id"] for e in events}
    assert len(ids) == 1, ids
    return {"id": ids.pop(), "text": text, "finish_reason": finish[-1] if finish else None,
            "tokens": usage[-1]["completion_tokens"] if usage else None}


def streamed(k: int) -> bool:
    return (k // PROMPTS) % 2 == 1


def counters(app) -> dict:
    text = app.metrics()
    return {"finished": metric(text, "vllm:request_success_total"),
            "length": metric(text, "vllm:request_success_total", finished_reason="length"),
            "generated": metric(text, "vllm:generation_tokens_total"),
            "preemptions": metric(text, "vllm:num_preemptions_total")}


def test_200_concurrent_requests_with_preemption_lose_nothing(shared_app):
    app = shared_app
    wait_for("an idle replica", app.idle_and_empty, 60)
    status = app.status()
    assert status["num_blocks"] == SHARED_BLOCKS and status["override"] == SHARED_BLOCKS

    # The reference: each prompt alone on the replica.
    started = time.monotonic()
    reference = {}

    async def sequential():
        async with app.async_client() as client:
            for i in range(PROMPTS):
                reference[i] = await asyncio.wait_for(send(client, i, False), REQUEST_TIMEOUT_S)
    asyncio.run(sequential())
    sequential_s = time.monotonic() - started
    assert all(r["tokens"] == MAX_TOKENS for r in reference.values())

    before = counters(app)
    results: dict[int, dict] = {}
    failures: dict[int, str] = {}
    # What the engine itself saw, sampled from its gauges while the load runs (not the
    # client's own semaphore): how many requests ran at once and how many waited.
    peak = {"running": 0, "waiting": 0}
    sampling = threading.Event()

    def sample():
        while not sampling.is_set():
            text = app.metrics()
            peak["running"] = max(peak["running"], metric(text, "vllm:num_requests_running"))
            peak["waiting"] = max(peak["waiting"], metric(text, "vllm:num_requests_waiting"))
            sampling.wait(0.2)

    async def concurrent():
        gate = asyncio.Semaphore(CONCURRENCY)

        async def one(client, k):
            async with gate:
                try:
                    result = await asyncio.wait_for(
                        send(client, k % PROMPTS, streamed(k)), REQUEST_TIMEOUT_S)
                    assert k not in results, f"request {k} answered twice"
                    results[k] = result
                except Exception as e:  # noqa: BLE001 - every failure is counted and shown
                    failures[k] = f"{type(e).__name__}: {e}"

        async with app.async_client() as client:
            # Streamed and plain requests, and the copies of one prompt, in a mixed order.
            order = list(range(REQUESTS))
            random.Random(5).shuffle(order)
            await asyncio.gather(*(one(client, k) for k in order))

    started = time.monotonic()
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        asyncio.run(asyncio.wait_for(concurrent(), LOAD_TIMEOUT_S))
    finally:
        sampling.set()
        sampler.join(30)
    concurrent_s = time.monotonic() - started

    # Every KV block comes back once the replica is idle.
    kv = wait_for("every KV block to be free again", app.idle_and_empty, 60)
    after = counters(app)
    mismatched = sorted(k for k, r in results.items()
                        if r["text"] != reference[k % PROMPTS]["text"])
    record("load", requests=REQUESTS, concurrency=CONCURRENCY,
           peak_running=peak["running"], peak_waiting=peak["waiting"],
           failures=len(failures), mismatched_text=len(mismatched),
           preemptions=after["preemptions"] - before["preemptions"],
           sequential_s=round(sequential_s, 1), concurrent_s=round(concurrent_s, 1),
           kv_blocks_free_after=kv["usable_blocks"] - kv["used_blocks"],
           usable_blocks=kv["usable_blocks"])

    assert not failures, dict(list(failures.items())[:5])
    assert sorted(results) == list(range(REQUESTS))
    assert len({r["id"] for r in results.values()}) == REQUESTS  # no answer reused
    assert not mismatched, [(k, results[k]["text"], reference[k % PROMPTS]["text"])
                            for k in mismatched[:3]]
    assert all(r["finish_reason"] == "length" and r["tokens"] == MAX_TOKENS
               for r in results.values())
    # The engine saw each request exactly once: no retry duplicated one, none vanished.
    assert after["finished"] - before["finished"] == REQUESTS
    assert after["length"] - before["length"] == REQUESTS
    assert after["generated"] - before["generated"] == REQUESTS * MAX_TOKENS
    # The cache was too small for the batch: vLLM had to preempt and recompute.
    # More requests than it could run reached the engine: it queued some, and never ran
    # more than max_num_seqs at once.
    assert 1 <= peak["running"] <= SHARED_MAX_NUM_SEQS, peak
    assert peak["waiting"] > 0, peak
    assert after["preemptions"] > before["preemptions"]
    assert kv["used_blocks"] == 0 and kv["usable_blocks"] == SHARED_BLOCKS - 1
