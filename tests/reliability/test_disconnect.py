"""Client disconnects mid-stream: the engine aborts the request and frees its blocks.

50 clients each read a few token events of a long stream and hang up, while 8 other
streams run to the end next to them. The hung-up requests never finish in the engine (it
finishes only the 8 others and generates far fewer tokens than 50 full streams would), the
replica goes idle with every KV block free, and the 8 others get exactly the text they get
alone.
"""
from __future__ import annotations

import asyncio
import time

from .helpers import completion_body, metric, record, sse_events, wait_for
import pytest

pytestmark = pytest.mark.slow

DISCONNECTS = 50
LONG_TOKENS = 200      # what a disconnected stream asked for (prompt + 200 < 256)
OTHERS = 8
OTHER_TOKENS = 32
TIMEOUT_S = 180


def long_prompt(i: int) -> str:
    return f"hang up {i}: " + " ".join(f"z{(i * 5 + j) % 37}" for j in range(4))


def other_prompt(i: int) -> str:
    return f"stay {i}: " + " ".join(f"y{(i * 3 + j) % 29}" for j in range(6))


async def read_then_hang_up(app, i: int, events_wanted: int) -> int:
    """Read `events_wanted` token events, then close the connection mid-stream."""
    seen = 0
    async with app.async_client() as client:  # its own connection, closed on exit
        body = completion_body(long_prompt(i), LONG_TOKENS, stream=True)
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    seen += 1
                    if seen >= events_wanted:
                        break
    return seen


async def full_stream(client, i: int) -> tuple[str, str | None]:
    body = completion_body(other_prompt(i), OTHER_TOKENS, stream=True)
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        events = sse_events([line async for line in r.aiter_lines()])
    text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
    finish = [e["choices"][0]["finish_reason"] for e in events
              if e["choices"] and e["choices"][0]["finish_reason"]]
    return text, (finish[-1] if finish else None)


def test_50_disconnects_are_aborted_and_free_their_blocks(shared_app):
    app = shared_app
    wait_for("an idle replica", app.idle_and_empty, 60)
    reference = {i: app.complete(other_prompt(i), OTHER_TOKENS) for i in range(OTHERS)}

    text = app.metrics()
    before = {"length": metric(text, "vllm:request_success_total", finished_reason="length"),
              "finished": metric(text, "vllm:request_success_total"),
              "generated": metric(text, "vllm:generation_tokens_total")}
    hung_up: list[int] = []
    others: dict[int, tuple[str, str | None]] = {}
    failures: list[str] = []

    async def run():
        async def hang_up(i):
            try:
                hung_up.append(await asyncio.wait_for(
                    read_then_hang_up(app, i, 1 + i % 5), TIMEOUT_S))
            except Exception as e:  # noqa: BLE001
                failures.append(f"disconnect {i}: {type(e).__name__}: {e}")

        async def other(client, i):
            try:
                others[i] = await asyncio.wait_for(full_stream(client, i), TIMEOUT_S)
            except Exception as e:  # noqa: BLE001
                failures.append(f"stream {i}: {type(e).__name__}: {e}")

        async with app.async_client() as client:
            await asyncio.gather(*(hang_up(i) for i in range(DISCONNECTS)),
                                 *(other(client, i) for i in range(OTHERS)))

    started = time.monotonic()
    asyncio.run(run())
    hung_up_s = time.monotonic() - started
    kv = wait_for("the replica to go idle with every block free", app.idle_and_empty, 60)
    idle_s = time.monotonic() - started

    text = app.metrics()
    after = {"length": metric(text, "vllm:request_success_total", finished_reason="length"),
             "finished": metric(text, "vllm:request_success_total"),
             "generated": metric(text, "vllm:generation_tokens_total")}
    generated_by_hung_up = after["generated"] - before["generated"] - OTHERS * OTHER_TOKENS
    record("disconnect", disconnects=DISCONNECTS, other_streams=OTHERS, failures=len(failures),
           tokens_generated_for_hung_up=generated_by_hung_up,
           tokens_if_not_aborted=DISCONNECTS * LONG_TOKENS,
           hung_up_but_finished=after["finished"] - before["finished"] - OTHERS,
           all_done_s=round(hung_up_s, 1), idle_after_s=round(idle_s, 1),
           used_blocks_after=kv["used_blocks"])

    assert not failures, failures[:5]
    assert len(hung_up) == DISCONNECTS
    # The other streams were not disturbed.
    assert {i: t for i, (t, _) in others.items()} == reference
    assert {f for _, f in others.values()} == {"length"}
    # The 8 ran to the end; most of the 50 were stopped, not finished. Some finish first:
    # the hang-up reaches the engine only once Serve's proxy notices it, and on 2 saturated
    # cores a request that only started running when its client hung up can generate its
    # 200 tokens (about 4 s) before that. Measured over CI runs: 0 to 12 of the 50 finished,
    # 705 to 3625 tokens generated for them. Without aborts all 50 finish (10000 tokens), so
    # the bound is half: most were aborted. The exact guarantee (closing a stream closes its
    # engine stream at once, not when the GC runs) is pinned without load by
    # test_app_args.py::test_closing_a_stream_closes_the_engine_stream_at_once.
    finished_anyway = after["finished"] - before["finished"] - OTHERS
    assert after["length"] - before["length"] - OTHERS == finished_anyway
    assert 0 <= finished_anyway <= DISCONNECTS // 2, finished_anyway
    assert 0 <= generated_by_hung_up <= DISCONNECTS * LONG_TOKENS // 2
    assert kv["used_blocks"] == 0 and kv["running_requests"] == 0
