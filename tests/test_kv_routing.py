"""The KV-capacity router's ranking (pure logic; the router itself runs in the Serve test)."""
import pytest

from spyre_serve.serve.kv_routing import FREE_TOKENS, near_first, rank_by_free_kv, routing_stats


def test_most_free_kv_first_and_close_ones_share_the_first_rank():
    ranks = rank_by_free_kv({"a": 1000.0, "b": 9000.0, "c": 8500.0, "d": 4000.0}, band=0.1)
    assert ranks == [["b", "c"], ["d"], ["a"]]


def test_zero_band_keeps_only_the_best_in_front():
    assert rank_by_free_kv({"a": 10.0, "b": 20.0}, band=0.0) == [["b"], ["a"]]


def test_a_replica_without_a_report_yet_ranks_with_the_best():
    assert rank_by_free_kv({"new": None, "full": -300.0, "roomy": 500.0}, band=0.1) == [
        ["roomy", "new"], ["full"]]
    assert rank_by_free_kv({"x": None, "y": None}, band=0.1) == [["x", "y"]]
    assert rank_by_free_kv({}, band=0.1) == []


def test_waiting_demand_makes_free_tokens_negative():
    # 10 usable blocks of 64 = 640 tokens; 700 tokens of demand: 60 short.
    assert routing_stats(10, 64, 700.0) == {FREE_TOKENS: -60.0}


@pytest.mark.parametrize("band", [-0.1, 1.0])
def test_band_out_of_range_is_refused(band):
    from spyre_serve.serve.kv_routing import KVCapacityRouter
    router = KVCapacityRouter.__new__(KVCapacityRouter)
    with pytest.raises(ValueError, match="request_router_kwargs.band"):
        router.initialize_state(band=band)


def test_nearness_orders_replicas_only_within_a_rank():
    ranks = rank_by_free_kv({"far-big": 2000.0, "near-big": 1900.0, "near-small": 300.0},
                            band=0.5)
    assert ranks == [["far-big", "near-big"], ["near-small"]]
    # The proxy beside the small card still tries the big ones first, its own among them.
    assert near_first(ranks, {"near-big", "near-small"}) == [
        ["near-big"], ["far-big"], ["near-small"]]
    assert near_first(ranks, set()) == ranks
