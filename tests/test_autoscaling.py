"""Autoscaling on `spyre` demand, on Ray's fake multi-node autoscaler.

The head declares no cards; the only worker node type declares one. Serve starts the
first replica, whose placement group cannot be placed until the autoscaler adds a node;
load makes Serve ask for a second replica and the autoscaler a second node, where the
new replica runs its own block handshake and serves; without load both scale back down.

`ray.cluster_utils.AutoscalingCluster` cannot be used as it is with this Ray wheel: it
reads `autoscaler/_private/fake_multi_node/example.yaml`, which the wheel does not ship,
and its start() runs `ray stop --force`, which would kill every other Ray on the machine.
So the same fake provider is started here with `ray start --head --block`, in a temp dir
of its own (other local clusters never see it), and stopped by that process alone.
"""
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from support import MiB, free_port, start_ray_head, wait_for

pytestmark = pytest.mark.slow
APP = "autoscale"
NODE_TYPE = "spyre.worker"


def fake_autoscaling_config(gcs_address: str, head_cpus: int, worker_resources: dict,
                            max_workers: int) -> dict:
    return {
        "cluster_name": "spyre-fake",
        "max_workers": max_workers,
        # Without gcs_address the fake nodes join whatever listens on the default port 6379.
        "provider": {"type": "fake_multinode", "gcs_address": gcs_address,
                     "use_node_id_as_ip": True,
                     "disable_node_updaters": True, "disable_launch_config_check": True},
        "available_node_types": {
            "ray.head.default": {"resources": {"CPU": head_cpus}, "node_config": {},
                                 "max_workers": 0},
            NODE_TYPE: {"resources": worker_resources, "node_config": {},
                        "min_workers": 0, "max_workers": max_workers},
        },
        "head_node_type": "ray.head.default",
        "upscaling_speed": 1.0,
        # An idle node (no resources in use) is given back after 6 s.
        "idle_timeout_minutes": 0.1,
        **{key: {} for key in ("auth", "docker", "file_mounts")},
        **{key: [] for key in ("initialization_commands", "setup_commands",
                               "head_setup_commands", "worker_setup_commands",
                               "head_start_ray_commands", "worker_start_ray_commands",
                               "cluster_synced_files", "rsync_exclude", "rsync_filter")},
        "file_mounts_sync_continuously": False,
    }


class FakeAutoscalingCluster:
    def __init__(self, root: Path, worker_resources: dict, max_workers: int):
        self.root = root
        from ray.util import get_node_ip_address
        # The head binds the node IP, not 127.0.0.1.
        self.address = f"{get_node_ip_address()}:{free_port()}"
        self.config = root / "autoscaling.json"
        self.config.write_text(json.dumps(
            fake_autoscaling_config(self.address, 1, worker_resources, max_workers)))
        self.process = None

    def start(self) -> str:
        env = {**os.environ, "RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1",
               "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               # `ray start` turns token auth on, ray.init in a test process does not.
               "RAY_AUTH_MODE": "disabled",
               # CI runs the venv's Python unactivated: its `ray` is not on PATH.
               "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
        env.pop("RAY_ADDRESS", None)
        self.process, _ = start_ray_head(
            self.root / "ray", int(self.address.rsplit(":", 1)[1]), self.root / "head.log",
            cards=0, num_cpus=1, extra=(f"--autoscaling-config={self.config}",), env=env)
        return self.address

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(timeout=120)
        # Fake worker nodes are processes of the head's monitor; any it left behind carry
        # this cluster's own temp dir on their command line, and only they do.
        marker = str(self.root / "ray")
        for proc in Path("/proc").iterdir():
            if proc.name.isdigit():
                try:
                    if marker.encode() in (proc / "cmdline").read_bytes():
                        os.kill(int(proc.name), signal.SIGKILL)
                except (OSError, ProcessLookupError):
                    pass
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="module")
def autoscaling_cluster(tiny_model):
    """Its own fake cluster and this process's driver on it; the suite's driver (if any)
    is put back afterwards, so this module runs in any order."""
    import ray

    from conftest import connect_driver
    previous = ray.get_runtime_context().gcs_address if ray.is_initialized() else None
    ray.shutdown()
    saved_address = os.environ.pop("RAY_ADDRESS", None)
    root = Path(tempfile.mkdtemp(prefix="sas-", dir="/tmp"))
    cluster = FakeAutoscalingCluster(root, {"CPU": 1, "spyre": 1}, max_workers=2)
    address = cluster.start()
    try:
        wait_for("the fake head to accept drivers", lambda: _try_connect(ray, address), 120, 2)
        yield ray
    finally:
        ray.shutdown()
        cluster.stop()
        if saved_address is not None:
            os.environ["RAY_ADDRESS"] = saved_address
        if previous is not None:
            connect_driver(previous)


def _try_connect(ray, address: str) -> bool:
    try:
        ray.init(address=address, log_to_driver=False)
        return True
    except (ConnectionError, RuntimeError):
        return False


def worker_nodes(ray) -> int:
    return sum(1 for n in ray.nodes() if n["Alive"] and n["Resources"].get("spyre", 0) > 0)


def running_replicas(serve) -> int:
    app = serve.status().applications.get(APP)
    if app is not None and app.status == "DEPLOY_FAILED":
        # Serve would keep retrying; the cause is in the message.
        raise AssertionError(f"{APP} failed to deploy: {app.message}")
    if app is None or "SpyreLLM" not in app.deployments:
        return 0
    return app.deployments["SpyreLLM"].replica_states.get("RUNNING", 0)


def pending_spyre_groups(ray) -> int:
    return sum(1 for pg in ray.util.placement_group_table().values()
               if pg["state"] == "PENDING"
               and any("spyre" in b for b in pg["bundles"].values()))


class Load:
    """Keeps `concurrency` completions in flight until stopped; counts, per replica, the
    client completions each one answered (the `x-spyre-replica` response header), so a
    replica's own startup request can never pass for client traffic."""

    def __init__(self, url: str, model: str, concurrency: int):
        self.url, self.model, self.stop_event = url, model, threading.Event()
        self.threads = [threading.Thread(target=self._run, daemon=True)
                        for _ in range(concurrency)]
        self.completed = 0
        self.by_replica: Counter[str] = Counter()

    def _run(self):
        with httpx.Client(timeout=300) as client:
            while not self.stop_event.is_set():
                r = client.post(f"{self.url}/v1/completions", json={
                    "model": self.model, "prompt": "the quick brown fox", "max_tokens": 48,
                    "ignore_eos": True})
                if r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 48:
                    self.completed += 1
                    self.by_replica[r.headers["x-spyre-replica"]] += 1

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop_event.set()
        for t in self.threads:
            t.join(timeout=300)


# On one host every fake node shares the IP, so the EngineCore (a Ray driver of its own)
# attaches to the head's raylet: SpyreRayExecutor lifts vLLM's "driver node in the placement
# group" check, which on Spyre guards nothing (the driver touches no card).
@pytest.mark.timeout(3000)
def test_load_adds_a_replica_on_a_new_spyre_node_then_scales_down(autoscaling_cluster,
                                                                     tiny_model, tmp_path):
    ray = autoscaling_cluster
    from ray import serve

    from deployments.openai_app import build_app
    from spyre_serve.serve.app_args import AppArgs

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
    url = f"http://127.0.0.1:{port}"
    args = AppArgs(model=tiny_model, served_model_name="tiny", max_model_len=256,
                   max_num_seqs=4, replica_num_cpus=0.5,
                   # Fake nodes share this machine's disk: each keeps its own compile cache,
                   # so only the warm-start catalog can make the second node warm.
                   spyre={"card_memory_bytes": 256 * MiB,
                          "compile_cache_dir": str(tmp_path / "compile-cache" / "{node_id}")},
                   autoscaling_config={"min_replicas": 1, "max_replicas": 2,
                                       "target_ongoing_requests": 1,
                                       "upscale_delay_s": 2, "downscale_delay_s": 10,
                                       "look_back_period_s": 4, "metrics_interval_s": 1})
    assert worker_nodes(ray) == 0, "the head must declare no spyre cards"
    started = time.monotonic()
    # The first replica too can only be placed once the autoscaler added a spyre node.
    serve.run(build_app(args), name=APP, route_prefix="/", blocking=False)
    wait_for("the first replica", lambda: running_replicas(serve) == 1, 900, 2)
    print(f"first replica ready {time.monotonic() - started:.1f} s after serve.run")
    assert worker_nodes(ray) == 1
    first = httpx.get(f"{url}/spyre/status", timeout=60).json()["replica"]

    timeline, down = {}, {}
    with Load(url, "tiny", concurrency=4) as load:
        load_started = time.monotonic()
        wait_for("a placement group waiting for spyre",
                 lambda: pending_spyre_groups(ray) > 0 or worker_nodes(ray) == 2, 300, 0.5)
        timeline["pending_or_node"] = time.monotonic() - load_started
        wait_for("the autoscaler to add a second spyre node", lambda: worker_nodes(ray) == 2,
                 300, 1)
        timeline["second_node"] = time.monotonic() - load_started
        wait_for("the second replica", lambda: running_replicas(serve) == 2, 900, 2)
        timeline["second_replica_ready"] = time.monotonic() - load_started

        def second_replica_served():
            return {r: n for r, n in load.by_replica.items() if r != first and n > 0}
        served = wait_for("the second replica to answer client completions",
                          second_replica_served, 300, 0.5)
        timeline["second_replica_served"] = time.monotonic() - load_started
        (second,) = served
    assert load.by_replica[first] > 0, load.by_replica
    print("client completions per replica:", dict(load.by_replica))
    print("autoscale-up timeline (s since load began):", timeline)

    # The new replica sized its own cards: its status carries its own handshake.
    statuses = {}
    wait_for("the status of both replicas", lambda: statuses.update(
        {s["replica"]: s for s in [httpx.get(f"{url}/spyre/status", timeout=60).json()]})
        or len(statuses) == 2, 120, 0.2)
    for status in statuses.values():
        assert [r["rank"] for r in status["reports"]] == [0]
        assert status["reports"][0]["memory_budget_bytes"] == 256 * MiB
        assert status["num_blocks"] == status["reports"][0]["num_blocks"]
    assert statuses[first]["placement_group"] != statuses[second]["placement_group"]

    # Warm start: the first replica compiled and filled the cluster's catalog; the one on the
    # new node loaded its programs from there and compiled nothing, then reported afresh.
    cold, warm = statuses[first], statuses[second]
    key = cold["warm_start"]["key"]
    warmups = {name: (s["warm_start"]["state"], s["reports"][0]["warmup_seconds"],
                      s["ranks"][0]["warmup"]["compile_cache"]) for name, s in
               (("first", cold), ("second", warm))}
    print("warmups (state, seconds, compile cache):", warmups)
    assert cold["warm_start"]["state"] == "cold"
    assert cold["ranks"][0]["warmup"]["compile_cache"]["misses"] > 0
    assert warm["warm_start"]["state"] == f"warm (catalog {key})"
    assert warm["ranks"][0]["warmup"]["compile_cache"]["misses"] == 0
    assert warm["ranks"][0]["warmup"]["compile_cache"]["hits"] > 0
    assert warm["reports"][0]["warmup_seconds"] < cold["reports"][0]["warmup_seconds"]

    load_stopped = time.monotonic()
    wait_for("Serve to scale back to one replica", lambda: running_replicas(serve) == 1
             and serve.status().applications[APP].deployments["SpyreLLM"].replica_states
             == {"RUNNING": 1}, 300, 1)
    down["one_replica"] = time.monotonic() - load_stopped
    wait_for("the autoscaler to remove the idle node", lambda: worker_nodes(ray) == 1, 300, 1)
    down["one_node"] = time.monotonic() - load_stopped
    print("scale-down timeline (s since load stopped):", down)
    response = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": "after scale down", "max_tokens": 2})
    assert response.status_code == 200

    serve.delete(APP)
    wait_for("the last spyre node to go", lambda: worker_nodes(ray) == 0, 300, 1)
    serve.shutdown()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-s", "-q"]))
