"""The figures of a benchmark run: the scheduler's view during a load phase (from the
server's Prometheus /metrics), the settings each server really ran with, and the repeats
and sessions of a server combined into one result.

Both servers expose vLLM's own metrics (spyre_serve from the replica, next to its Spyre
gauges), so the same names answer the same questions on both.
"""
from __future__ import annotations

import asyncio
import math
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


# --- One run's figures, combined: repeats, sessions, settings, CPU accounting. ---

INFO_LINE = re.compile(r"^vllm:cache_config_info\{([^}]*)\}")
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def cache_config_info(text: str) -> dict[str, str]:
    """The labels of vLLM's `vllm:cache_config_info` gauge (its CacheConfig, num_gpu_blocks
    included), as a server's /metrics states them; {} if it has none."""
    for line in text.splitlines():
        m = INFO_LINE.match(line.strip())
        if m:
            return dict(LABEL.findall(m.group(1)))
    return {}


def engine_facts(lines) -> dict:
    """Settings each server's engine really ran with, as its log states them."""
    text = "\n".join(t for _, t in lines)
    facts = {}
    for key, pattern in (("max_num_batched_tokens", r"max_num_batched_tokens=(\d+)"),
                         # "async_scheduling=False" or, in vLLM's non-default args, "'async_scheduling': False"
                         ("async_scheduling", r"async_scheduling['\"]?\s*[=:]\s*(\w+)"),
                         ("dtype", r"(?<![\w])dtype=([\w.]+)"),
                         ("kv_cache_tokens", r"KV cache size: ([\d,]+) tokens")):
        m = re.search(pattern, text)
        facts[key] = m.group(1) if m else None
    facts["async_scheduling_disabled_by_executor"] = "Async scheduling will be disabled" in text
    return facts


def _int_or_none(value) -> int | None:
    try:
        return int(str(value).replace(",", ""))
    except (TypeError, ValueError):
        return None


def kv_blocks_of(cache_info: dict, status: dict | None, facts: dict, block_size: int) -> dict:
    """The KV block count a server ran with, and where each figure came from: its
    /metrics (vLLM's CacheConfig), spyre_serve's /spyre/status (the coordinator's decision),
    its log (KV cache size in tokens / block size). The first of these that is known wins."""
    tokens = _int_or_none(facts.get("kv_cache_tokens"))
    sources = {"metrics_num_gpu_blocks": _int_or_none(cache_info.get("num_gpu_blocks")),
               "status_num_blocks": _int_or_none((status or {}).get("num_blocks")),
               "log_tokens_div_block_size": None if tokens is None else tokens // block_size}
    resolved = next((v for v in sources.values() if v is not None), None)
    return {"kv_blocks": resolved, "kv_blocks_sources": sources}


def median(values):
    values = sorted(v for v in values if v is not None)
    return values[len(values) // 2] if values else None


def min_of(values):
    values = [v for v in values if v is not None]
    return min(values) if values else None


def max_of(values):
    values = [v for v in values if v is not None]
    return max(values) if values else None


# Counts of one repeat that add up over repeats (a median would hide a bad repeat).
SUMMED = ("errors", "short_outputs")


def combine_repeats(measured: list[dict]) -> dict:
    """Medians of the load figures, errors and short outputs summed, the scheduler's
    extremes, every repeat kept."""
    loads = [m["load"] for m in measured]
    combined = {key: median([load[key] for load in loads])
                if isinstance(loads[0][key], (int, float)) else loads[0][key]
                for key in loads[0]}
    for key in SUMMED:
        combined[key] = sum(load.get(key) or 0 for load in loads)
    combined["first_errors"] = [e for load in loads for e in load["first_errors"]][:3]
    scheduler = {"peak_running": max_of(m["scheduler"]["peak_running"] for m in measured),
                 "peak_waiting": max_of(m["scheduler"]["peak_waiting"] for m in measured),
                 "peak_kv_usage_perc": max_of(m["scheduler"]["peak_kv_usage_perc"] for m in measured),
                 "preemptions": sum(m["scheduler"]["preemptions"] or 0 for m in measured),
                 "server_ttft_ms_mean": median([m["scheduler"]["server_ttft_ms_mean"] for m in measured]),
                 "server_itl_ms_mean": median([m["scheduler"]["server_itl_ms_mean"] for m in measured])}
    spread = {key: [min_of(load[key] for load in loads), max_of(load[key] for load in loads)]
              for key in ("output_tokens_per_s", "ttft_ms_p50", "tpot_ms_p50")}
    return {
        "concurrency": measured[0]["concurrency"], "rate": measured[0]["rate"],
        "load": combined, "load_range_over_repeats": spread, "scheduler": scheduler,
        "client_cores_busy": median([m["client_cores_busy"] for m in measured]),
        "background_cores_busy": median([m["background_cores_busy"] for m in measured]),
        "loadavg_1m_after": [m["loadavg_1m_after"] for m in measured],
        "repeats": measured,
    }


SESSION_KEYS = ("repeat", "run_position", "failed_starts", "cold_start", "settings",
                "handshake_s", "teardown", "log")


def combine_sessions(sessions: list[dict]) -> dict:
    """One server's sessions (one start, one pass over the phases, one stop each) as one
    result: the phases' repeats are the sessions, the rest is the first session's, and each
    session's start, settings and memory stay under "sessions"."""
    first = sessions[0]
    combined = {k: v for k, v in first.items() if k != "phases"}
    combined["phases"] = {name: combine_repeats([s["phases"][name] for s in sessions])
                          for name in first["phases"]}
    if "handshake_s" in first:
        combined["handshake_s"] = median([s.get("handshake_s") for s in sessions])
    combined["sessions"] = [
        {**{k: s.get(k) for k in SESSION_KEYS},
         "memory": {"idle_pss_mib": s["memory"]["idle"]["pss_mib"],
                    "after_load_pss_mib": s["memory"]["after_load"]["pss_mib"],
                    "peak_rss_mib": s["memory"]["peak_rss_mib"]} if "memory" in s else None}
        for s in sessions]
    return combined


def kv_usefulness(config: dict, block_budget: int, ours: dict, theirs: dict) -> dict:
    """vllm-spyre reserves max_model_len/64 blocks per sequence up front; vLLM's scheduler
    (ours, on the handshake's count) takes blocks as the sequence grows."""
    block_size = config["block_size"]
    per_seq_static = math.ceil(config["max_model_len"] / block_size)
    per_seq_dynamic = math.ceil((config["prompt_len"] + config["output_len"]) / block_size)
    usable = block_budget - 1  # vLLM's null block

    def over_phases(server, key, combine):
        values = [p["scheduler"][key] for p in server["phases"].values()
                  if p["scheduler"][key] is not None]
        return combine(values) if values else None

    return {
        "block_budget": block_budget,
        "static_blocks_per_seq": per_seq_static,
        "static_blocks_needed_for_max_num_seqs": config["max_num_seqs"] * per_seq_static + 1,
        "static_max_concurrent_seqs": usable // per_seq_static,
        "dynamic_blocks_per_seq": per_seq_dynamic,
        "dynamic_max_concurrent_seqs": min(config["max_num_seqs"], usable // per_seq_dynamic),
        "peak_running": {"spyre_serve": over_phases(ours, "peak_running", max),
                         "vllm": over_phases(theirs, "peak_running", max)},
        "preemptions": {"spyre_serve": over_phases(ours, "preemptions", sum),
                        "vllm": over_phases(theirs, "preemptions", sum)},
        "peak_kv_usage_perc": {"spyre_serve": over_phases(ours, "peak_kv_usage_perc", max),
                               "vllm": over_phases(theirs, "peak_kv_usage_perc", max)},
    }
