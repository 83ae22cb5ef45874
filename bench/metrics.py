"""The scheduler's view during a load phase, from the server's Prometheus /metrics.

Both servers expose vLLM's own metrics (spyre_serve from the replica, next to its Spyre
gauges), so the same names answer the same questions on both.
"""
from __future__ import annotations

import asyncio
import re

import httpx

SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)$")


def parse(text: str) -> dict[str, float]:
    """Metric name -> value, summed over label sets (one engine, one model here)."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        m = SAMPLE.match(line.strip())
        if m:
            values[m.group(1)] = values.get(m.group(1), 0.0) + float(m.group(3))
    return values


async def scrape(client: httpx.AsyncClient, base_url: str) -> dict[str, float]:
    r = await client.get(f"{base_url}/metrics", timeout=30)
    r.raise_for_status()
    return parse(r.text)


class SchedulerWatch:
    """Samples running/waiting requests and KV usage while a phase runs."""

    def __init__(self, base_url: str, interval_s: float = 0.25):
        self.base_url = base_url
        self.interval_s = interval_s
        self.samples: list[dict[str, float]] = []
        self.before: dict[str, float] = {}
        self.after: dict[str, float] = {}

    async def __aenter__(self):
        self.client = httpx.AsyncClient()
        self.before = await scrape(self.client, self.base_url)
        self.task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc):
        self.task.cancel()
        try:
            await self.task
        except asyncio.CancelledError:
            pass
        self.after = await scrape(self.client, self.base_url)
        await self.client.aclose()

    async def _run(self):
        while True:
            try:
                self.samples.append(await scrape(self.client, self.base_url))
            except httpx.HTTPError:
                pass
            await asyncio.sleep(self.interval_s)

    def summary(self) -> dict:
        def peak(name):
            return max((s.get(name, 0.0) for s in self.samples), default=None)

        def delta(name):
            return self.after.get(name, 0.0) - self.before.get(name, 0.0)

        def mean_ms(histogram):
            count = delta(histogram + "_count")
            return round(1000 * delta(histogram + "_sum") / count, 2) if count else None

        usage = peak("vllm:kv_cache_usage_perc")
        return {
            "peak_running": peak("vllm:num_requests_running"),
            "peak_waiting": peak("vllm:num_requests_waiting"),
            "peak_kv_usage_perc": None if usage is None else round(usage * 100, 1),
            "preemptions": delta("vllm:num_preemptions_total"),
            "server_generation_tokens": delta("vllm:generation_tokens_total"),
            # The engine frontend's own clock (mean over the phase): a gap to the client's
            # figures is time spent between the frontend and the client (HTTP, proxy).
            "server_ttft_ms_mean": mean_ms("vllm:time_to_first_token_seconds"),
            "server_itl_ms_mean": mean_ms("vllm:inter_token_latency_seconds"),
            "samples": len(self.samples),
        }
