"""KV cache figures of one replica: what the status endpoint shows and Prometheus scrapes.

vLLM's own Prometheus metrics (KV usage, preemptions, TTFT, tokens) live in the replica's
default registry, filled by vLLM's stat logger. Next to them go the Spyre gauges, in block
units, labelled with the replica so a scrape of several replicas stays apart.
"""
from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from vllm.v1.metrics.loggers import StatLoggerBase

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class LatestSchedulerStats:
    """A vLLM stat-logger factory whose loggers keep the newest scheduler stats here."""

    def __init__(self):
        self.scheduler = None
        self.preemptions = 0  # since the engine started

    def __call__(self, vllm_config, engine_index: int = 0) -> StatLoggerBase:
        return _Recorder(self)

    @property
    def kv_cache_usage(self) -> float:
        return self.scheduler.kv_cache_usage if self.scheduler is not None else 0.0


class _Recorder(StatLoggerBase):
    def __init__(self, latest: LatestSchedulerStats):
        self.latest = latest

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
        if scheduler_stats is not None:
            self.latest.scheduler = scheduler_stats
        if iteration_stats is not None:
            self.latest.preemptions += iteration_stats.num_preempted_reqs

    def log_engine_initialized(self) -> None:
        pass


def kv_blocks(num_blocks: int, usable_blocks: int, latest: LatestSchedulerStats) -> dict:
    """vLLM's usage is a fraction of the usable blocks (its null block never holds tokens)."""
    usage = latest.kv_cache_usage
    scheduler = latest.scheduler
    return {
        "num_blocks": num_blocks,
        "usable_blocks": usable_blocks,
        "used_blocks": round(usage * usable_blocks),
        "usage": usage,
        "running_requests": scheduler.num_running_reqs if scheduler else 0,
        "waiting_requests": scheduler.num_waiting_reqs if scheduler else 0,
        # Requests vLLM preempted (blocks taken back, recomputed later) since the engine
        # started: the sign that this replica's cards are short of KV blocks.
        "preemptions": latest.preemptions,
    }


class SpyreKVCollector:
    def __init__(self, replica: str, model_name: str, kv: callable, warmup: dict):
        self.labels = {"replica": replica, "model_name": model_name}
        self.kv = kv
        self.warmup = warmup

    def collect(self):
        kv = self.kv()
        for name, key, text in (
                ("spyre_kv_blocks_total", "num_blocks",
                 "KV blocks the block handshake gave every card of this replica"),
                ("spyre_kv_blocks_usable", "usable_blocks",
                 "KV blocks that can hold tokens (vLLM keeps one as its null block)"),
                ("spyre_kv_blocks_used", "used_blocks", "KV blocks holding tokens now")):
            gauge = GaugeMetricFamily(name, text, labels=list(self.labels))
            gauge.add_metric(list(self.labels.values()), kv[key])
            yield gauge
        # Whether scale-ups pay compile time: the slowest rank's warmup, and how it started.
        gauge = GaugeMetricFamily(
            "spyre_warmup_seconds", "Warmup of this replica's cards (slowest rank), by start: "
            "warm (compiles from the warm-start catalog) or cold", labels=[*self.labels, "start"])
        gauge.add_metric([*self.labels.values(), self.warmup["start"]], self.warmup["seconds"])
        yield gauge


def warmup_figures(handshake: dict) -> dict:
    """The replica's warmup for the metrics: slowest rank, and warm or cold."""
    state = handshake.get("warm_start", {}).get("state", "cold")
    return {"seconds": max(r.get("warmup_seconds", 0.0) for r in handshake["reports"]),
            "start": "warm" if state.startswith("warm") else "cold"}


class ReplicaMetrics:
    def __init__(self, replica: str, model_name: str, kv: callable, warmup: dict):
        self.spyre_registry = CollectorRegistry()
        self.spyre_registry.register(SpyreKVCollector(replica, model_name, kv, warmup))

    def exposition(self) -> bytes:
        return generate_latest(REGISTRY) + generate_latest(self.spyre_registry)
