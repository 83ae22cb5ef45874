"""The KV-capacity router in a real Serve app: Serve loads it from request_router_config,
requests go through it, and each replica's routing stats are its free KV tokens: the whole
usable cache when idle, less while requests hold and wait for blocks."""
from __future__ import annotations

import concurrent.futures

import httpx
import pytest

from support import MiB, wait_for

pytestmark = pytest.mark.slow

APP = "kv-route-test"
ROUTER = "spyre_serve.serve.kv_routing:KVCapacityRouter"


@pytest.fixture(scope="module")
def served(serve_instance, tiny_model):
    from ray import serve

    from deployments.openai_app import build_app
    from spyre_serve.serve.app_args import AppArgs

    port = serve_instance.ensure()
    args = AppArgs(model=tiny_model, served_model_name="tiny", max_model_len=256,
                   max_num_seqs=2, spyre={"card_memory_bytes": 256 * MiB}, replica_num_cpus=0.5,
                   engine_kwargs={"num_gpu_blocks_override": 12},
                   request_router_config={"request_router_class": ROUTER,
                                          "request_router_kwargs": {"band": 0.2},
                                          "request_routing_stats_period_s": 0.2})
    serve.run(build_app(args), name=APP, route_prefix="/")
    yield f"http://127.0.0.1:{port}", serve.get_app_handle(APP)
    if serve_instance.alive():
        serve.delete(APP)


def test_requests_go_through_our_router(served):
    """Serve imports the router class when it deploys (a wrong path fails the deploy)."""
    from ray import serve
    url, _ = served
    assert serve.status().applications[APP].deployments["SpyreLLM"].status == "HEALTHY"
    answer = httpx.post(f"{url}/v1/completions", json={
        "model": "tiny", "prompt": "route me", "max_tokens": 4, "temperature": 0}, timeout=60)
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 4


def test_routing_stats_are_free_kv_tokens(served):
    url, handle = served
    status = httpx.get(f"{url}/spyre/status", timeout=30).json()
    capacity = status["usable_blocks"] * status["block_size"]
    assert capacity == 11 * 64  # 12 blocks, one is vLLM's null block

    def free() -> float:
        return handle.record_routing_stats.remote().result(timeout_s=30)["free_kv_tokens"]

    wait_for("an idle replica to report its whole cache free", lambda: free() == capacity, 60)
    # 64 prompt tokens + 120 generated: 3 blocks each at the end.
    body = {"model": "tiny", "prompt": [5] * 64, "max_tokens": 120, "min_tokens": 120,
            "temperature": 0}
    lowest = capacity
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        # 4 requests, 2 run (max_num_seqs) and 2 wait: demand beyond what is held.
        futures = [pool.submit(httpx.post, f"{url}/v1/completions", json=body, timeout=300)
                   for _ in range(4)]
        while not all(f.done() for f in futures):
            lowest = min(lowest, free())
        answers = [f.result() for f in futures]
        assert all(a.status_code == 200 for a in answers), [a.text[:300] for a in answers]
    assert lowest < capacity - 2 * 64  # at least two requests' blocks were counted
    wait_for("the blocks to be free again", lambda: free() == capacity, 60)
