"""KVCapacityPolicy on real Serve: a few long requests (far below Serve's ongoing-request
target) fill a replica's KV blocks, and Serve adds a replica on that signal alone."""
import threading

import httpx
import pytest

from support import MiB, free_port, wait_for

pytestmark = pytest.mark.slow
APP, MODEL = "kv-scale", "tiny-kv"


def replicas(serve) -> dict:
    app = serve.status().applications.get(APP)
    if app is None or "SpyreLLM" not in app.deployments:
        return {}
    return app.deployments["SpyreLLM"].replica_states


def test_kv_demand_adds_a_replica_the_request_rule_would_not(ray_cluster, tiny_model):
    from ray import serve

    from deployments.openai_app import build_app
    from spyre_serve.app import AppArgs

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    url = f"http://127.0.0.1:{port}"
    args = AppArgs(
        model=tiny_model, served_model_name=MODEL, max_model_len=256, max_num_seqs=4,
        card_memory_bytes=256 * MiB, replica_num_cpus=0.5,
        # 11 usable blocks = 704 tokens per replica.
        engine_kwargs={"num_gpu_blocks_override": 12},
        autoscaling_config={
            "min_replicas": 1, "max_replicas": 2,
            # Serve's own rule: 4 in flight against a target of 64 wants 1 replica.
            "target_ongoing_requests": 64, "upscale_delay_s": 1, "downscale_delay_s": 600,
            "look_back_period_s": 2, "metrics_interval_s": 0.5,
            "policy": {"policy_function": "spyre_serve.kv_autoscaling:KVCapacityPolicy",
                       "policy_kwargs": {"target_kv_utilization": 0.5}}})
    serve.run(build_app(args), name=APP, route_prefix="/")
    try:
        assert replicas(serve) == {"RUNNING": 1}
        stop, served = threading.Event(), []

        def long_requests():
            with httpx.Client(timeout=300) as client:
                while not stop.is_set():
                    r = client.post(f"{url}/v1/completions", json={
                        "model": MODEL, "prompt": "the quick brown fox", "max_tokens": 220,
                        "ignore_eos": True})
                    served.append(r.status_code)

        threads = [threading.Thread(target=long_requests, daemon=True) for _ in range(4)]
        for t in threads:
            t.start()
        try:
            wait_for("a second replica on KV demand",
                     lambda: replicas(serve).get("RUNNING", 0) == 2, 400, 1)
        finally:
            stop.set()
            for t in threads:
                t.join(300)
        assert served and set(served) == {200}
        assert len(threads) < 64  # never near the ongoing-request target
    finally:
        serve.delete(APP)
        serve.shutdown()
