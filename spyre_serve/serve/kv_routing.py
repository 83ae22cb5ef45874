"""Route each request to a replica with room in its KV cache, the quantity the block
handshake measures.

Serve's default router (power of two choices) compares ongoing-request counts. On Spyre
two replicas with one request each can be far apart: one holds a 2000-token conversation
in most of its blocks, the other a short prompt. A new request sent to the full one waits
or preempts while the other has room. Each replica reports its free KV tokens to Serve
(`record_routing_stats`, every `request_routing_stats_period_s`); this router ranks the
replicas by that figure, puts those close to the best in the first rank (the nearest of
them first), and leaves the choice among them to Serve's own queue-length probe, so a burst
between two stats updates still spreads by queue length instead of piling on one replica.

Ray Serve's custom request-router interface (`request_router_config.request_router_class`);
hand-written because neither Serve nor Ray Serve LLM routes on KV capacity (Ray Serve LLM's
PrefixCacheAffinityRouter routes on prompt prefixes). The ranking is a pure function, unit
tested; a replica that has not reported yet ranks with the best, so a new one gets traffic.
"""
from __future__ import annotations

from typing import Hashable, Mapping, TypeVar

from ray.serve.request_router import (
    FIFOMixin,
    LocalityMixin,
    PendingRequest,
    RequestRouter,
    RunningReplica,
)

FREE_TOKENS = "free_kv_tokens"
R = TypeVar("R", bound=Hashable)


def rank_by_free_kv(free_tokens: Mapping[R, float | None], band: float) -> list[list[R]]:
    """Ranks of replicas, most free KV tokens first.

    The first rank holds every replica within `band` (a fraction) of the best figure, and
    every replica without a figure yet; the others follow one rank each, most free first.
    """
    known = {r: t for r, t in free_tokens.items() if t is not None}
    unknown = [r for r, t in free_tokens.items() if t is None]
    if not known:
        return [unknown] if unknown else []
    best = max(known.values())
    first = [r for r, t in known.items() if t >= best * (1 - band)] + unknown
    rest = sorted((r for r in known if r not in first), key=lambda r: -known[r])
    return [first] + [[r] for r in rest]


def near_first(ranks: list[list[R]], near: set[R]) -> list[list[R]]:
    """Within each rank, the replicas near this router (Serve's locality: same node, then
    same zone) before the others; capacity first, nearness only among equals.

    Serve runs a proxy on every node by default, and each one's locality preference alone
    would send a request to its own node's replica whatever that replica's room (measured:
    with proxies on three nodes, 8 of 20 requests went to a card with a tenth of the
    other's free blocks; the driver's handle, which has no node, sent all 20 to the large)."""
    ordered = []
    for rank in ranks:
        ordered += [[r for r in rank if r in near], [r for r in rank if r not in near]]
    return [rank for rank in ordered if rank]


def routing_stats(usable_blocks: int, block_size: int, demand_tokens: float) -> dict[str, float]:
    """What one replica reports to Serve's routers: its KV capacity in tokens less the
    demand of its requests (held blocks, and an estimate for those still waiting, as the
    autoscaling policy counts it). Negative when requests wait for blocks."""
    return {FREE_TOKENS: float(usable_blocks * block_size - demand_tokens)}


# The stats lag the replicas by up to a stats period plus a controller broadcast (measured:
# with two like replicas and 0.1, a request that had just finished still counted, and the
# next went to the busy replica). Within half the best figure Serve's queue-length probe,
# which asks the replicas at routing time, decides; unlike cards still differ by more.
DEFAULT_BAND = 0.5


class KVCapacityRouter(FIFOMixin, LocalityMixin, RequestRouter):
    """`request_router_kwargs`: `band` (default 0.5): replicas within this fraction of the
    most free KV tokens share the first rank."""

    def initialize_state(self, band: float = DEFAULT_BAND, **_: object) -> None:
        if not 0 <= band < 1:
            raise ValueError(f"request_router_kwargs.band must be in [0, 1), got {band}")
        self.band = band

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        by_id = {r.replica_id: r for r in candidate_replicas}
        ranks = rank_by_free_kv(
            {rid: r.routing_stats.get(FREE_TOKENS) for rid, r in by_id.items()},
            getattr(self, "band", DEFAULT_BAND))
        ranks = near_first(ranks, set(self.apply_locality_routing(pending_request)))
        return [[by_id[rid] for rid in rank] for rank in ranks]

