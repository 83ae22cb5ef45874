"""The real engine on two simulated cards of different budgets: one Ray actor per card."""
import pytest
from conftest import shutdown_llm
from support import MiB
from engine_helpers import (
    MAX_MODEL_LEN,
    assert_greedy_matches_transformers,
    assert_nothing_compiled_since_warmup,
    greedy,
)

from spyre_serve.handshake.coordinator import replica_status
from spyre_serve.vllm_plugin.engine import engine_kwargs, start_llm

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tp2(ray_cluster, tiny_model):
    llm = start_llm(engine_kwargs(tiny_model, tensor_parallel_size=2, max_model_len=MAX_MODEL_LEN,
                                  max_num_seqs=4,
                                  spyre={"card_memory_bytes": [96 * MiB, 64 * MiB]}))
    yield llm
    shutdown_llm(llm)


def test_tp2_greedy_equals_transformers(tp2, tiny_model):
    assert_greedy_matches_transformers(tp2, tiny_model)


def test_tp2_every_rank_resized_to_the_smallest_report(tp2):
    tp2.generate(["a step on both ranks"], greedy(4))
    status = replica_status(tp2.collective_rpc("spyre_status"))
    by_rank = {r["rank"]: r for r in status["reports"]}
    assert by_rank[0]["memory_budget_bytes"] == 96 * MiB
    assert by_rank[1]["memory_budget_bytes"] == 64 * MiB
    assert by_rank[0]["num_blocks"] > by_rank[1]["num_blocks"]
    assert status["num_blocks"] == by_rank[1]["num_blocks"] and status["limiting_rank"] == 1
    assert len(status["ranks"]) == 2
    for rank in status["ranks"]:
        # every layer's cache on every actor: [num_blocks, kv_heads, 64, 2 * head_size]
        assert {shape[0] for shape in rank["kv_cache_shapes"]} == {status["num_blocks"]}
        assert {shape[2] for shape in rank["kv_cache_shapes"]} == {64}
        # warmup ran on exactly 4 blocks
        assert {shape[0] for shape in rank["warmup"]["kv_cache_shapes"]} == {4}
        # every rank ran the steps above over its own step channel
        assert rank["step_channel"]["steps"] > 0
    assert {r["device"] for r in status["ranks"]} == {r["device"] for r in status["reports"]}


def test_serving_after_the_resize_compiles_nothing(tp2):
    assert_nothing_compiled_since_warmup(tp2)
