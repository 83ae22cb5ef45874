"""The KV-capacity router's ranking (pure logic; the router itself runs in the Serve test)."""
import pytest

from spyre_serve.serve.kv_routing import (
    FREE_TOKENS,
    PER_REQUEST_TOKENS,
    REQUESTS,
    near_first,
    rank_by_free_kv,
    routing_stats,
)


def free(**tokens):
    """Routing stats of replicas that report free tokens only."""
    return {r: None if t is None else {FREE_TOKENS: t} for r, t in tokens.items()}


def test_most_free_kv_first_and_close_ones_share_the_first_rank():
    ranks = rank_by_free_kv(free(a=1000.0, b=9000.0, c=8500.0, d=4000.0), band=0.1)
    assert ranks == [["b", "c"], ["d"], ["a"]]


def test_zero_band_keeps_only_the_best_in_front():
    assert rank_by_free_kv(free(a=10.0, b=20.0), band=0.0) == [["b"], ["a"]]


def test_a_replica_without_a_report_yet_ranks_with_the_best():
    assert rank_by_free_kv(free(new=None, full=-300.0, roomy=500.0), band=0.1) == [
        ["roomy", "new"], ["full"]]
    assert rank_by_free_kv(free(x=None, y=None), band=0.1) == [["x", "y"]]
    assert rank_by_free_kv({}, band=0.1) == []


def test_a_burst_between_stats_spreads_over_replicas_the_stale_figures_call_full():
    """Four closed-loop requests ended together on "a"; its figure, taken before, says full.
    The router sends the next four one by one, counting what it sent (Serve's count)."""
    stats = {"a": {FREE_TOKENS: 64.0, REQUESTS: 4.0, PER_REQUEST_TOKENS: 176.0},
             "b": {FREE_TOKENS: 768.0, REQUESTS: 0.0, PER_REQUEST_TOKENS: 256.0}}
    # Uncorrected (no counts known), "a" is passed over: the whole burst would go to "b".
    assert rank_by_free_kv(stats, band=0.5) == [["b"], ["a"]]
    sent = {"a": 0, "b": 0}
    for _ in range(4):
        (first, *_) = rank_by_free_kv(stats, band=0.5, in_flight=sent)
        # Serve's probe among the first rank: fewest requests in flight (ties: the first).
        chosen = min(first, key=lambda r: sent[r])
        sent[chosen] += 1
    assert sent == {"a": 2, "b": 2}


def test_when_every_replica_is_short_the_least_short_leads():
    # Negative figures (requests waiting for blocks): the band still measures from the best.
    assert rank_by_free_kv(free(a=-100.0, b=-140.0, c=-400.0), band=0.5) == [["a", "b"], ["c"]]


def test_waiting_demand_makes_free_tokens_negative():
    # 10 usable blocks of 64 = 640 tokens; 700 tokens of demand from 2 requests: 60 short.
    assert routing_stats(10, 64, 700.0, 4, 2) == {
        FREE_TOKENS: -60.0, REQUESTS: 2.0, PER_REQUEST_TOKENS: 350.0}
    # With none, the next request is taken at full length (4 blocks of 64).
    assert routing_stats(10, 64, 0.0, 4, 0)[PER_REQUEST_TOKENS] == 256.0


@pytest.mark.parametrize("band", [-0.1, 1.0])
def test_band_out_of_range_is_refused(band):
    from spyre_serve.serve.kv_routing import KVCapacityRouter
    router = KVCapacityRouter.__new__(KVCapacityRouter)
    with pytest.raises(ValueError, match="request_router_kwargs.band"):
        router.initialize_state(band=band)


def test_nearness_orders_replicas_only_within_a_rank():
    ranks = rank_by_free_kv(free(**{"far-big": 2000.0, "near-big": 1900.0,
                                    "near-small": 300.0}), band=0.5)
    assert ranks == [["far-big", "near-big"], ["near-small"]]
    # The proxy beside the small card still tries the big ones first, its own among them.
    assert near_first(ranks, {"near-big", "near-small"}) == [
        ["near-big"], ["far-big"], ["near-small"]]
    assert near_first(ranks, set()) == ranks
