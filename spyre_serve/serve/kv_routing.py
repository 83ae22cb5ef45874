"""Route each request to a replica with room in its KV cache, the quantity the block
handshake measures.

Serve's default router (power of two choices) compares ongoing-request counts. On Spyre
two replicas with one request each can be far apart: one holds a 2000-token conversation
in most of its blocks, the other a short prompt. A new request sent to the full one waits
or preempts while the other has room. Each replica reports its free KV tokens to Serve
(`record_routing_stats`, every `request_routing_stats_period_s`); this router ranks the
replicas by that figure, corrected by the requests each has gained or lost since (Serve's
own count, which the router keeps as it sends and as requests finish), and puts in the first
rank those close to the best; Serve's queue-length probe chooses among them, so a burst
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
REQUESTS = "requests"                      # running and waiting when the figure was taken
PER_REQUEST_TOKENS = "tokens_per_request"  # what each of them holds, on average
R = TypeVar("R", bound=Hashable)


def free_now(stats: Mapping[str, float], in_flight: int | None) -> float:
    """A replica's free KV tokens, its stats figure corrected by the requests it has gained
    or lost since the figure was taken (`in_flight`: Serve's own count of its requests,
    kept by the router as it sends them and as they finish; None: unknown, no correction)."""
    free = stats[FREE_TOKENS]
    then = stats.get(REQUESTS)
    if in_flight is None or then is None:
        return free
    return free + (then - in_flight) * stats.get(PER_REQUEST_TOKENS, 0.0)


def rank_by_free_kv(stats: Mapping[R, Mapping[str, float] | None], band: float,
                    in_flight: Mapping[R, int | None] | None = None) -> list[list[R]]:
    """Ranks of replicas, most free KV tokens first (`free_now`: stats corrected by the
    requests `in_flight` now).

    The first rank holds every replica within `band` (a fraction) of the best figure and
    every one without a figure yet; Serve's queue-length probe chooses among them. The
    others follow one rank each, most free first.

    Why the correction: the figures lag by a stats period, and closed-loop clients whose
    requests end in the same step send their next ones at once. Ranked by the stale figures,
    the four ended on one replica (which still looked full) all went to the other, and the
    load swung between the two replicas as a whole, each preempting in turn (measured in
    the autoscaling test: 8 preemptions in 32 completions on two replicas, as many as one
    replica alone).
    """
    in_flight = in_flight or {}
    known = {r: s for r, s in stats.items() if s and s.get(FREE_TOKENS) is not None}
    unknown = [r for r in stats if r not in known]
    if not known:
        return [unknown] if unknown else []
    free = {r: free_now(s, in_flight.get(r)) for r, s in known.items()}
    best = max(free.values())
    close = best - band * abs(best)

    first = [r for r in known if free[r] >= close] + unknown
    rest = sorted((r for r in known if r not in first), key=lambda r: -free[r])
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


def routing_stats(usable_blocks: int, block_size: int, demand_tokens: float,
                  blocks_per_request: int, requests: int) -> dict[str, float]:
    """What one replica reports to Serve's routers: its KV capacity in tokens less the
    demand of its `requests` (held blocks, and an estimate for those still waiting, as the
    autoscaling policy counts it; negative when requests wait for blocks), and what each
    of them holds on average; with none, what the next may grow to: a full-length request
    (`blocks_per_request`, the handshake's blocks_needed)."""
    return {FREE_TOKENS: float(usable_blocks * block_size - demand_tokens),
            REQUESTS: float(requests),
            PER_REQUEST_TOKENS: (demand_tokens / requests if requests
                                 else float(blocks_per_request * block_size))}


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
            {rid: r.routing_stats for rid, r in by_id.items()}, getattr(self, "band", DEFAULT_BAND),
            {rid: self.replica_queue_len_cache.get(rid) for rid in by_id})
        ranks = near_first(ranks, set(self.apply_locality_routing(pending_request)))
        return [[by_id[rid] for rid in rank] for rank in ranks]

