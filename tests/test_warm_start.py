"""Warm starts through the catalog, on the real engine: cold fills it, warm compiles nothing.

Each start gets a compile-cache directory of its own, as a new node would have, and the
catalog is a directory (`cache_uri`) the test can read and damage. The Ray-actor catalog and
a new node added by the autoscaler are covered by tests/test_autoscaling.py.
"""
import json

import pytest
from conftest import shutdown_llm
from engine_helpers import PROMPTS, greedy, token_ids
from support import MiB

from spyre_serve.handshake.coordinator import replica_status
from spyre_serve.vllm_plugin.engine import engine_kwargs, start_llm

pytestmark = pytest.mark.slow


def start(tiny_model, root, node: str):
    llm = start_llm(engine_kwargs(tiny_model, max_model_len=256, max_num_seqs=2, spyre={
        "card_memory_bytes": 64 * MiB, "cache_uri": str(root / "catalog"),
        "compile_cache_dir": str(root / node)}))
    try:
        status = replica_status(llm.collective_rpc("spyre_status"))
        output = token_ids(llm.generate(PROMPTS[:2], greedy(8)))
    finally:
        shutdown_llm(llm)
    return status, output


@pytest.fixture(scope="module")
def first_two(ray_cluster, tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("warm")
    cold = start(tiny_model, root, "node-a")
    filled = json.loads(entry_file(root, cold[0]).read_text())
    warm = start(tiny_model, root, "node-b")
    for name, (status, _) in (("cold", cold), ("warm", warm)):
        print(name, status["warm_start"]["state"], status["ranks"][0]["warmup"])
    return root, filled, cold, warm


def entry_file(root, status):
    return root / "catalog" / f"{status['warm_start']['key']}.json"


def test_a_cold_start_fills_the_catalog(first_two):
    _, entry, (status, _), _ = first_two
    assert status["warm_start"]["state"] == "cold"
    assert status["ranks"][0]["warmup"]["compile_cache"]["misses"] > 0
    assert entry["reports"] == [{"rank": 0, "num_blocks": status["reports"][0]["num_blocks"],
                                 "bytes_per_block": status["reports"][0]["bytes_per_block"]}]
    assert entry["artifacts"][0]  # the packed compile cache of rank 0
    assert entry["num_blocks"] == status["num_blocks"]


def test_the_next_start_on_a_new_node_is_warm_and_the_same(first_two):
    root, _, (cold, cold_out), (warm, warm_out) = first_two
    key = cold["warm_start"]["key"]
    assert warm["warm_start"]["key"] == key and warm["warm_start"]["state"] == f"warm (catalog {key})"
    assert warm["reports"][0]["start"] == "warm"
    counts = warm["ranks"][0]["warmup"]["compile_cache"]
    assert counts["hits"] > 0 and counts["misses"] == 0   # nothing compiled on the new node
    # Still a real handshake: a fresh report, decided on, kept by the catalog (the simulated
    # compiler measures resident memory, so its count may move by a block or two).
    assert warm["reports"][0]["created_at"] > cold["reports"][0]["created_at"]
    assert warm["num_blocks"] == warm["reports"][0]["num_blocks"]
    stored = json.loads(entry_file(root, warm).read_text())["reports"][0]["num_blocks"]
    assert stored == warm["num_blocks"]
    assert warm_out == cold_out


def test_an_entry_that_disagrees_with_the_fresh_report_is_replaced(first_two, tiny_model):
    root, _, (cold, _), _ = first_two
    path = entry_file(root, cold)
    entry = json.loads(path.read_text())
    entry["reports"][0]["num_blocks"] += 1000
    path.write_text(json.dumps(entry))
    status, _ = start(tiny_model, root, "node-c")
    fresh = status["reports"][0]["num_blocks"]
    assert status["warm_start"]["replaced"] == [
        f"rank 0: catalog {entry['reports'][0]['num_blocks']} blocks, fresh {fresh}"]
    assert status["num_blocks"] == fresh                       # the fresh report is trusted
    assert json.loads(path.read_text())["reports"][0]["num_blocks"] == fresh


def test_a_corrupt_entry_is_ignored_and_the_start_is_cold(first_two, tiny_model):
    root, _, (cold, _), _ = first_two
    path = entry_file(root, cold)
    path.write_text(path.read_text()[:100])
    status, _ = start(tiny_model, root, "node-d")
    assert status["warm_start"]["state"] == "cold"
    assert status["ranks"][0]["warmup"]["compile_cache"]["misses"] > 0
    assert json.loads(path.read_text())["key"] == cold["warm_start"]["key"]   # rewritten whole
