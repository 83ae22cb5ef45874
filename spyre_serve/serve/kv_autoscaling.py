"""Scale on KV capacity, the quantity the block handshake measures.

On Spyre the KV blocks run out before the request count does: a few long requests fill a
replica (vLLM then preempts and recomputes) while Serve's default rule sees "2 ongoing
requests, target 16" and adds nothing. Each replica reports to Serve's autoscaler
(`record_autoscaling_stats`, Ray 2.60) its token demand against its capacity; this policy
(Ray Serve's custom-policy interface, `autoscaling_config.policy`) sizes the deployment so
demand fills `target_kv_utilization` of the capacity, and takes the larger of that and
Serve's own ongoing-request rule, so neither signal is lost. Serve's wrapper still applies
min/max_replicas and the up/downscale delays.

Hand-written because neither Serve nor Ray Serve LLM has a KV-capacity signal (Ray Serve
LLM scales on ongoing requests); the arithmetic is pure functions, unit tested.
"""
from __future__ import annotations

import math
from typing import Any

from ray.serve.autoscaling_policy import replica_queue_length_autoscaling_policy

DEMAND = "kv_demand_tokens"
CAPACITY = "kv_capacity_tokens"
PREEMPTIONS = "kv_preemptions_per_s"


def kv_demand_tokens(used_blocks: int, block_size: int, running: int, waiting: int) -> float:
    """Tokens the replica's requests hold, plus an estimate for those still waiting.

    Held: the blocks in use, in tokens. A waiting request's size is unknown until it is
    scheduled; it is counted as the average running request (at least one block).
    """
    held = used_blocks * block_size
    per_request = max(block_size, held / running) if running else block_size
    return held + waiting * per_request


def autoscaling_stats(used_blocks: int, usable_blocks: int, block_size: int, running: int,
                      waiting: int, preemptions_per_s: float) -> dict[str, float]:
    """What one replica reports to Serve's autoscaler every metrics interval."""
    return {DEMAND: float(kv_demand_tokens(used_blocks, block_size, running, waiting)),
            CAPACITY: float(usable_blocks * block_size),
            PREEMPTIONS: float(preemptions_per_s)}


def replicas_for_kv(demand: float, capacity_per_replica: float, target_utilization: float,
                    preempting: bool, current: int) -> int:
    """Replicas whose capacity holds the demand at the target utilisation.

    Preemption means the cards are already short: at least one more replica than now.
    Scale-down follows from the same formula: fewer replicas only when those left still
    hold the demand at the target (the headroom is 1 - target_utilization).
    """
    if capacity_per_replica <= 0:
        return current
    needed = math.ceil(demand / (capacity_per_replica * target_utilization)) if demand else 0
    if preempting:
        needed = max(needed, current + 1)
    return needed


class KVCapacityPolicy:
    """`autoscaling_config.policy.policy_function: spyre_serve.serve.kv_autoscaling:KVCapacityPolicy`.

    policy_kwargs: target_kv_utilization (default 0.8), use_ongoing_requests (default true:
    also apply Serve's own ongoing-request rule and take the larger answer).
    """

    def __init__(self, target_kv_utilization: float = 0.8, use_ongoing_requests: bool = True):
        if not 0 < target_kv_utilization <= 1:
            raise ValueError(f"target_kv_utilization={target_kv_utilization}: give a fraction "
                             "in (0, 1], e.g. 0.8")
        self.target = target_kv_utilization
        self.use_ongoing_requests = use_ongoing_requests

    def __call__(self, ctx) -> tuple[float, dict[str, Any]]:
        metrics = ctx.aggregated_metrics or {}
        demand = sum(metrics.get(DEMAND, {}).values())
        capacities = list(metrics.get(CAPACITY, {}).values())
        preempting = sum(metrics.get(PREEMPTIONS, {}).values()) > 0
        current = ctx.current_num_replicas
        desired = current
        if capacities:
            desired = replicas_for_kv(demand, sum(capacities) / len(capacities), self.target,
                                      preempting, current)
        by_requests = None
        if self.use_ongoing_requests:
            # Serve's own rule (a pure function of ctx; Serve's wrapper applies the delays
            # and bounds to whatever this returns, once).
            by_requests, _ = replica_queue_length_autoscaling_policy(ctx)
        state = {"kv": {"demand_tokens": demand, "replicas_for_kv": desired,
                        "replicas_for_requests": by_requests, "preempting": preempting}}
        return max(desired, by_requests or 0), state
