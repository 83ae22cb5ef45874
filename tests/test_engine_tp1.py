"""The real engine on one simulated card: outputs, override, preemption, no recompile."""
import json
from pathlib import Path

import pytest
from conftest import shutdown_llm
from support import MiB
from engine_helpers import (
    MAX_MODEL_LEN,
    PROMPTS,
    assert_greedy_matches_transformers,
    assert_nothing_compiled_since_warmup,
    greedy,
    metric,
    token_ids,
)

from spyre_serve.handshake.coordinator import replica_status
from spyre_serve.vllm_plugin.engine import engine_kwargs, start_llm

pytestmark = pytest.mark.slow
CARD_THREADS = 2


@pytest.fixture(scope="module")
def tp1(ray_cluster, tiny_model):
    # 10 blocks (9 usable) hold 2 sequences at full length: 8 at once must be preempted.
    llm = start_llm(engine_kwargs(tiny_model, max_model_len=MAX_MODEL_LEN, max_num_seqs=8,
                                  num_gpu_blocks_override=10,
                                  spyre={"card_memory_bytes": 64 * MiB,
                                         "cpu_threads_per_card": CARD_THREADS}))
    yield llm
    shutdown_llm(llm)


def test_tp1_greedy_equals_transformers(tp1, tiny_model):
    assert_greedy_matches_transformers(tp1, tiny_model)


def test_override_wins_and_is_recorded(tp1, tiny_model):
    status = replica_status(tp1.collective_rpc("spyre_status"))
    assert status["reports"][0]["num_blocks"] > 10  # the card could hold more
    # Measured on the tensors themselves, not read back from the setting or the code:
    # 10 blocks, each of 64 tokens x K and V x every layer's KV heads x head size x fp32.
    config = json.loads((Path(tiny_model) / "config.json").read_text())
    head_size = config["hidden_size"] // config["num_attention_heads"]
    block_bytes = (64 * 2 * config["num_hidden_layers"] * config["num_key_value_heads"]
                   * head_size * 4)
    rank = status["ranks"][0]
    assert {s[0] for s in rank["kv_cache_shapes"]} == {10}
    assert rank["kv_cache_bytes"] == 10 * block_bytes
    assert status["reports"][0]["bytes_per_block"] == block_bytes


def test_more_sequences_than_blocks_all_finish_through_preemption(tp1, tiny_model):
    max_tokens = MAX_MODEL_LEN - 20  # every sequence ends near full length: 4 blocks each
    preempted_before = metric(tp1, "vllm:num_preemptions")
    together = token_ids(tp1.generate(PROMPTS, greedy(max_tokens)))
    assert metric(tp1, "vllm:num_preemptions") > preempted_before
    one_by_one = [token_ids(tp1.generate([p], greedy(max_tokens)))[0] for p in PROMPTS[:3]]
    assert together[:3] == one_by_one
    assert all(len(t) == max_tokens for t in together)
    assert metric(tp1, "vllm:kv_cache_usage_perc") == 0.0  # every block is free again


def test_serving_after_the_resize_compiles_nothing(tp1):
    assert_nothing_compiled_since_warmup(tp1)


def test_the_card_computes_on_the_nodes_cpus_not_on_rays_one_thread(tp1):
    # Ray gives an actor that reserves no CPU OMP_NUM_THREADS=1; a lone TP=1 card takes
    # the CPUs of its node less one (card_actors.card_process_env), set explicitly here so
    # that a 2-core machine, where the default is also one, tests the setting too.
    rank = replica_status(tp1.collective_rpc("spyre_status"))["ranks"][0]
    assert rank["torch_num_threads"] == CARD_THREADS


def test_the_engine_sends_the_next_step_while_the_card_runs_this_one(tp1):
    # vLLM's CPU platform turns async scheduling off; a card actor is a Ray round trip
    # away, which it hides, so the platform keeps vLLM's default. The greedy and
    # preemption tests above ran under it; this checks the rank's own config says so.
    rank = replica_status(tp1.collective_rpc("spyre_status"))["ranks"][0]
    assert rank["async_scheduling"] is True


def test_steps_and_calls_reach_the_card_over_the_step_channel(tp1):
    # Once the engine serves, its steps and calls go over the rank's ZeroMQ socket, not
    # Ray calls (step_channel.py); this status call is itself one of those calls.
    before = replica_status(tp1.collective_rpc("spyre_status"))["ranks"][0]["step_channel"]
    tp1.generate(PROMPTS[:2], greedy(8))
    after = replica_status(tp1.collective_rpc("spyre_status"))["ranks"][0]["step_channel"]
    assert after["address"].startswith("ipc://")
    assert after["steps"] >= before["steps"] + 8  # at least one step per token
    assert after["calls"] == before["calls"] + 1


def test_a_failing_call_leaves_the_channel_in_order(tp1, tiny_model):
    # A rank's error comes back as the answer to its own call, so the answers after it
    # still match their requests: the engine goes on serving the same outputs.
    with pytest.raises(Exception, match="no_such_worker_method"):
        tp1.collective_rpc("no_such_worker_method")
    assert_greedy_matches_transformers(tp1, tiny_model)
