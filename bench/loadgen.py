"""Streaming load for an OpenAI-compatible /v1/completions endpoint.

Every request sends a fixed number of prompt token ids and asks for a fixed number of
output tokens (min_tokens = max_tokens, ignore_eos), so both servers do the same work.
`continuous_usage_stats` makes each streamed chunk carry the running completion-token
count: a chunk that holds two tokens (or one that decodes to no text) is still counted
right, without asking for logprobs.
"""
from __future__ import annotations

import asyncio
import random
import re
import time
from dataclasses import dataclass, field

import aiohttp


@dataclass
class RequestResult:
    sent: float                 # perf_counter when the request left
    first_token: float | None = None
    done: float | None = None
    output_tokens: int = 0
    # (seconds since the previous token-bearing chunk, tokens this chunk brought)
    gaps: list[tuple[float, int]] = field(default_factory=list)
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.sent


def make_prompts(count: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Distinct prompts, so prefix caching helps neither server; ids past the first 8
    keep clear of the special tokens small vocabularies put at the start."""
    rng = random.Random(seed)
    return [[rng.randrange(8, vocab_size) for _ in range(length)] for _ in range(count)]


def request_body(model: str, prompt: list[int], output_len: int) -> dict:
    return {
        "model": model, "prompt": prompt, "max_tokens": output_len, "min_tokens": output_len,
        "ignore_eos": True, "temperature": 0.0, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }


# The running token count in a chunk; a regex is far cheaper than json.loads on every
# chunk, and the client shares two cores with the server it measures.
COMPLETION_TOKENS = re.compile(rb'"completion_tokens":\s*(\d+)')


async def one_request(session: aiohttp.ClientSession, url: str, body: dict) -> RequestResult:
    result = RequestResult(sent=time.perf_counter())
    last = result.sent
    try:
        async with session.post(url, json=body) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.read())[:200]!r}"
                return result
            async for line in response.content:
                if not line.startswith(b"data: "):
                    continue
                if line.startswith(b"data: [DONE]"):
                    break
                m = COMPLETION_TOKENS.search(line)
                if m is None:
                    continue
                tokens = int(m.group(1))
                new = tokens - result.output_tokens
                if new <= 0:  # the closing usage chunk repeats the count
                    continue
                now = time.perf_counter()
                if result.first_token is None:
                    result.first_token = now
                else:
                    result.gaps.append((now - last, new))
                last = now
                result.output_tokens = tokens
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        result.error = f"{type(e).__name__}: {e}"
    if result.error is None and result.first_token is None:
        # Counted as an error either way; named, so the verdict can say what went wrong.
        result.error = "the stream ended without a token"
    result.done = time.perf_counter()
    return result


def new_client(max_connections: int) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=max_connections),
        timeout=aiohttp.ClientTimeout(total=600, sock_connect=30))


async def closed_loop(url: str, bodies: list[dict], concurrency: int) -> tuple[list[RequestResult], float]:
    """`concurrency` users, each sending its next request when the last one finished."""
    queue = list(reversed(bodies))
    results: list[RequestResult] = []
    async with new_client(concurrency) as client:
        async def user():
            while queue:
                results.append(await one_request(client, url, queue.pop()))
        started = time.perf_counter()
        await asyncio.gather(*(user() for _ in range(concurrency)))
        return results, time.perf_counter() - started


def poisson_arrivals(count: int, rate: float, seed: int) -> list[float]:
    """Seconds from the start at which each request is sent: exponential gaps, fixed seed."""
    rng = random.Random(seed)
    at, times = 0.0, []
    for _ in range(count):
        times.append(at)
        at += rng.expovariate(rate)
    return times


async def open_loop(url: str, bodies: list[dict], rate: float, seed: int) -> tuple[list[RequestResult], float]:
    """Requests leave on a fixed Poisson schedule, whether or not earlier ones finished."""
    arrivals = poisson_arrivals(len(bodies), rate, seed)
    async with new_client(len(bodies)) as client:
        started = time.perf_counter()

        async def send_at(at: float, body: dict) -> RequestResult:
            await asyncio.sleep(max(0.0, started + at - time.perf_counter()))
            return await one_request(client, url, body)

        results = await asyncio.gather(*(send_at(a, b) for a, b in zip(arrivals, bodies)))
        return list(results), time.perf_counter() - started


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (q in 0..100)."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def summarize(results: list[RequestResult], wall_s: float, expected_output: int) -> dict:
    """The phase's figures over the requests that succeeded. A failed request leaves the
    token count and the latency percentiles, so these figures are only comparable when
    `errors` and `short_outputs` are 0: bench/verdict.py judges nothing otherwise."""
    ok = [r for r in results if r.error is None and r.first_token is not None]
    ttfts = [r.ttft for r in ok]
    # Inter-token latency as a client lives it: the wait between two chunks that bring
    # tokens. A server that falls behind sends several tokens in one chunk (vLLM merges
    # the outputs a slow reader has not taken yet); spreading that wait over its tokens
    # would hide the stall, so TPOT (the mean per token, per request) is reported beside it.
    itls = [gap for r in ok for gap, _ in r.gaps]
    tpots = [(r.done - r.first_token) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    chunks = sum(len(r.gaps) + 1 for r in ok)
    latencies = [r.done - r.sent for r in ok]
    tokens = sum(r.output_tokens for r in ok)
    ms = lambda v: None if v is None else round(v * 1000, 2)  # noqa: E731
    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "first_errors": [r.error for r in results if r.error][:3],
        "short_outputs": sum(1 for r in ok if r.output_tokens != expected_output),
        "wall_s": round(wall_s, 3),
        "output_tokens": tokens,
        "output_tokens_per_s": round(tokens / wall_s, 2) if wall_s else None,
        "requests_per_s": round(len(ok) / wall_s, 3) if wall_s else None,
        "ttft_ms_p50": ms(percentile(ttfts, 50)),
        "ttft_ms_p99": ms(percentile(ttfts, 99)),
        "itl_ms_p50": ms(percentile(itls, 50)),
        "itl_ms_p99": ms(percentile(itls, 99)),
        "tpot_ms_p50": ms(percentile(tpots, 50)),
        "tokens_per_chunk": round(tokens / chunks, 2) if chunks else None,
        "latency_ms_p50": ms(percentile(latencies, 50)),
    }
