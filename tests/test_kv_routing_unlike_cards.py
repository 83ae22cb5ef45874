"""Two replicas on unlike cards: spyre_serve's KV-capacity router against Serve's default.

Two Ray nodes of one simulated card each; a node label (`spyre-serve/card-memory-bytes`)
gives one a small card and the other a large one, so the two replicas' block handshakes
pick different block counts. The same closed-loop load (the same clients, prompts and
lengths, greedy) runs through Serve's default router (power of two choices on queue
length), then through KVCapacityRouter on the same nodes. Under the KV router the large
replica holds a larger share of the requests in flight, and the run preempts less.

The cluster is `ray.cluster_utils.Cluster` (Ray's own several-nodes-on-one-machine
helper): nodes join with their labels, nothing autoscales, its temp dir is this module's.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

import httpx
import pytest

from support import MiB, free_port, replica_routing_stats, suite_driver_set_aside, wait_for

pytestmark = pytest.mark.slow

APP = "unlike-cards"
ROUTER = "spyre_serve.serve.kv_routing:KVCapacityRouter"
# 8 layers of 8 KV heads: 1 MiB per 64-token block, so a card's budget decides its block
# count, not the noise (a few MiB) of measuring resident memory.
BLOCK_BYTES = MiB
# What the weights and warmup's activation peak take of a card (resident memory, measured
# once freed heap memory is handed back): 42 MiB on both cards since the KV program is
# compiled ahead of time; 72 MiB in every start before, when torch.compile's dynamo held
# 30 MiB more. Before that hand-back it was 75.9-77.1 MiB alone and 4-7 MiB more late in
# a full suite run (heap garbage, different at every start). The small card gets 14 MiB
# of room: about 14 usable blocks, and room for one full-length request (4 blocks, which
# the handshake insists on) with 10 MiB to spare should the overhead grow back. Twelve
# clients keep the default router's share of the small card (about six requests of 2 to
# 4 blocks each, up to 24) above what it holds, so it preempts (given 21 blocks it did
# not); the large card's 88 MiB hold every client's request at full length (48). The
# handshake's own figures are checked below.
OVERHEAD_BYTES = 42 * MiB
SMALL_BYTES, LARGE_BYTES = OVERHEAD_BYTES + 14 * MiB, OVERHEAD_BYTES + 88 * MiB
# A request of 128 prompt tokens and 120 generated ones ends in 4 blocks.
PROMPT, OUTPUT, CLIENTS, REQUESTS_PER_CLIENT = [11] * 128, 120, 12, 4


@pytest.fixture(scope="module")
def unlike_cards():
    """Serve on a cluster of a cardless head and two one-card nodes of unlike budgets."""
    from ray.cluster_utils import Cluster

    from spyre_serve.ops.models import tiny_llama
    from spyre_serve.vllm_plugin.settings import CARD_MEMORY_LABEL
    model = str(tiny_llama(layers=8, kv_heads=8))
    with suite_driver_set_aside() as ray:
        root = Path(tempfile.mkdtemp(prefix="uc-", dir="/tmp"))  # short: Ray's socket paths
        (root / "ray").mkdir()
        saved = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_TMPDIR")}
        os.environ["RAY_AUTH_MODE"] = "disabled"  # as spyre-serve's own `ray start` does
        # Cluster writes its address to <Ray's default temp dir>/ray_current_cluster; here
        # that is this module's dir, which exists (a fresh $TMPDIR has no ray/ in it), and no
        # other cluster on the machine is pointed at this one.
        os.environ["RAY_TMPDIR"] = str(root)
        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 1, "temp_dir": str(root / "ray"), "include_dashboard": False})
        try:
            for budget in (SMALL_BYTES, LARGE_BYTES):
                cluster.add_node(num_cpus=1, resources={"spyre": 1},
                                 labels={CARD_MEMORY_LABEL: str(budget)})
            ray.init(address=cluster.address, log_to_driver=False)
            from ray import serve
            port = free_port()
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            yield serve, f"http://127.0.0.1:{port}", model
            serve.shutdown()
        finally:
            ray.shutdown()
            cluster.shutdown()
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            shutil.rmtree(root, ignore_errors=True)


def deploy(serve, model: str, router: bool) -> str:
    """One app per router: a Serve handle (the proxy's too) builds its router once, so a
    redeploy under the same name with another router class would keep the old router."""
    from deployments.openai_app import build_app
    from spyre_serve.serve.app_args import AppArgs
    router_config = {"request_router_class": ROUTER,  # its default band
                     "request_routing_stats_period_s": 0.2} if router else None
    args = AppArgs(model=model, served_model_name="tiny", max_model_len=256, max_num_seqs=8,
                   num_replicas=2, replica_num_cpus=0.5, request_router_config=router_config,
                   spyre={"card_memory_bytes": 1024 * MiB})  # every node here has a label
    name = f"{APP}-{'kv-router' if router else 'default-router'}"
    # Not serve.run: while one replica runs, Serve retries a failing other one forever.
    serve._run(build_app(args), name=name, route_prefix=f"/{name}", _blocking=False)

    def running() -> bool:
        app = serve.status().applications.get(name)
        assert app is None or app.status != "DEPLOY_FAILED", app.message
        return app is not None and app.status == "RUNNING"
    started = time.monotonic()
    try:
        wait_for(f"{name}'s two replicas", running, 600, 2)
    except AssertionError:
        print("serve status:", serve.status().applications.get(name))
        raise
    print(f"{name}: both replicas running {time.monotonic() - started:.0f} s after deploy")
    return name


def run_load(url: str) -> dict:
    """CLIENTS clients, each sending REQUESTS_PER_CLIENT requests one after another.

    A replica's mean requests in flight is the time its requests took, summed, over the
    run's wall time (Little's law), from the `x-spyre-replica` header of each answer."""
    busy: dict[str, float] = defaultdict(float)
    answered: Counter[str] = Counter()
    failures: list[str] = []
    lock = threading.Lock()

    def client():
        with httpx.Client(timeout=600) as http:
            for _ in range(REQUESTS_PER_CLIENT):
                started = time.monotonic()
                r = http.post(f"{url}/v1/completions", json={
                    "model": "tiny", "prompt": PROMPT, "max_tokens": OUTPUT,
                    "ignore_eos": True, "temperature": 0})
                with lock:
                    if r.status_code == 200 and r.json()["usage"]["completion_tokens"] == OUTPUT:
                        busy[r.headers["x-spyre-replica"]] += time.monotonic() - started
                        answered[r.headers["x-spyre-replica"]] += 1
                    else:
                        failures.append(f"{r.status_code}: {r.text[:200]}")

    started = time.monotonic()
    threads = [threading.Thread(target=client) for _ in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(900)
    wall = time.monotonic() - started
    assert not failures, failures[:3]
    return {"wall_s": round(wall, 1), "answered": dict(answered),
            "in_flight": {r: round(b / wall, 2) for r, b in busy.items()}}


def measured_run(serve, proxy: str, model: str, router: bool) -> dict:
    name = deploy(serve, model, router)
    before = replica_routing_stats(name)
    assert len(before) == 2, before
    # Idle, a replica's free KV tokens are its usable blocks: the node labels' budgets set
    # them (the report's own figures are in each replica's log table).
    small, large = sorted(before, key=lambda r: before[r]["free_kv_tokens"])
    blocks = {"small": int(before[small]["free_kv_tokens"]) // 64 + 1,
              "large": int(before[large]["free_kv_tokens"]) // 64 + 1}
    # One full-length request fits on the small card, and it stays small: under 20 usable
    # blocks, fewer than the default router's share needs (room for 14). The large holds
    # three times as many.
    assert 4 <= blocks["small"] - 1 < 20 and blocks["large"] >= 3 * blocks["small"], blocks
    load = run_load(f"{proxy}/{name}")
    after = replica_routing_stats(name)
    assert set(after) == set(before), "a replica was replaced during the load"
    serve.delete(name)  # frees both cards for the next run
    in_flight = {label: load["in_flight"].get(r, 0.0) for label, r in (("small", small),
                                                                      ("large", large))}
    return {"blocks": blocks, "wall_s": load["wall_s"], "in_flight": in_flight,
            "answered": {label: load["answered"].get(r, 0) for label, r in (("small", small),
                                                                            ("large", large))},
            "preemptions": {label: int(after[r]["preemptions"] - before[r]["preemptions"])
                            for label, r in (("small", small), ("large", large))}}


@pytest.mark.timeout(1800)
def test_kv_router_gives_the_larger_card_more_and_preempts_less(unlike_cards):
    serve, url, model = unlike_cards
    runs = {"default": measured_run(serve, url, model, router=False),
            "kv_router": measured_run(serve, url, model, router=True)}
    print("unlike cards, same load under each router:", runs)
    share = {name: run["in_flight"]["large"] / sum(run["in_flight"].values())
             for name, run in runs.items()}
    preempted = {name: sum(run["preemptions"].values()) for name, run in runs.items()}
    print(f"large card's share of requests in flight: {share}; preemptions: {preempted}")
    # Serve's default router splits by queue length, so the small card is overfilled.
    assert preempted["default"] > 0
    assert share["kv_router"] > share["default"] and share["kv_router"] > 0.6
    assert preempted["kv_router"] < preempted["default"]
