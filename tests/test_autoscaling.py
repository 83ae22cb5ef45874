"""Autoscaling on `spyre` demand and on KV capacity, and losing a node, on Ray's fake
multi-node autoscaler.

The head declares no cards; the only worker node type declares one. Serve starts each
app's first replica, whose placement group cannot be placed until the autoscaler adds a
node. Two apps on small cards get the same load of a few long requests, well under Serve's
ongoing-request target, which makes vLLM preempt: the one on spyre_serve's KV-capacity
policy gets a second replica (on a new node, started warm from the catalog) and stops
preempting; the one on Serve's default policy does not scale. Without load the first
scales back down. Then the node under a replica is killed while it streams.

`ray.cluster_utils.AutoscalingCluster` cannot be used as it is with this Ray wheel: it
reads `autoscaler/_private/fake_multi_node/example.yaml`, which the wheel does not ship,
and its start() runs `ray stop --force`, which would kill every other Ray on the machine.
So the same fake provider is started here with `ray start --head --block`, in a temp dir
of its own (other local clusters never see it), and stopped by that process alone.
"""
import fcntl
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
import psutil
import pytest

from support import (MiB, free_port, replica_routing_stats, replica_status, replica_statuses,
                     start_ray_head, suite_driver_set_aside, wait_for)

from spyre_serve.vllm_plugin.card_actors import is_card_actor_process

pytestmark = pytest.mark.slow
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
        # A dead node is marked dead after 3 missed 1 s health checks, not Ray's 5 x 3 s.
        health = json.dumps({"health_check_period_ms": 1000, "health_check_failure_threshold": 3})
        self.process, _ = start_ray_head(
            self.root / "ray", int(self.address.rsplit(":", 1)[1]), self.root / "head.log",
            cards=0, num_cpus=1, env=env,
            extra=(f"--autoscaling-config={self.config}", f"--system-config={health}"))
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
    """Its own fake cluster and this process's driver on it."""
    with suite_driver_set_aside() as ray:
        root = Path(tempfile.mkdtemp(prefix="sas-", dir="/tmp"))
        # Two apps of one node each, a second replica, and a replacement for a lost node.
        cluster = FakeAutoscalingCluster(root, {"CPU": 1, "spyre": 1}, max_workers=4)
        address = cluster.start()
        try:
            wait_for("the fake head to accept drivers", lambda: _try_connect(ray, address),
                     120, 2)
            yield ray, str(root / "ray")  # on the command line of each of its raylets
        finally:
            ray.shutdown()
            # As `spyre-serve stop` (and the suite's own head) does, so the head's SIGTERM
            # drain finds its node idle instead of waiting 30 s for the catalog actor.
            from spyre_serve.ops.shutdown import drain_cluster
            drain_cluster(address, head_stops=True)
            cluster.stop()


def _try_connect(ray, address: str) -> bool:
    try:
        ray.init(address=address, log_to_driver=False)
        return True
    except (ConnectionError, RuntimeError):
        return False


KV_APP, DEFAULT_APP = "kv-policy", "default-policy"
KV_POLICY = "spyre_serve.serve.kv_autoscaling:KVCapacityPolicy"
# Small cards: 13 KV blocks, 12 usable (768 tokens). A request of 128 prompt tokens and 120
# generated ones holds 3 blocks at first and 4 at the end: four on one replica need up to
# 16 and vLLM preempts; on two replicas even three on one have room.
BLOCKS, PROMPT, OUTPUT, CONCURRENCY = 13, [7] * 128, 120, 4
# Serve's own rule sees 4 ongoing requests against a target of 8: no reason to scale.
TARGET_ONGOING = 8
# How long Serve's default policy gets the load (its KV-policy twin asked in 18-38 s).
DEFAULT_LOAD_S = 45
# Completions per replica the rate on two replicas is taken over. The window opens once
# every request the first replica took alone has ended (each load thread finished one since
# both replicas served), so the hand-over's preemptions do not count on two. Runs that
# measured as many preemptions on two replicas as on one (0.25 against 0.25, 8 in 32) were
# the KV router's fault, not the window's: the four requests, ending together, went to
# one replica at once and the load swung between the two (kv_routing.rank_by_free_kv).
ON_TWO_WINDOW = 16


def app_args(tiny_model: str, compile_cache: Path, kv_policy: bool):
    from spyre_serve.serve.app_args import AppArgs
    autoscaling = {"min_replicas": 1, "max_replicas": 2,
                   "target_ongoing_requests": TARGET_ONGOING,
                   # A scale-down waits 30 s: short lulls between requests keep both.
                   "upscale_delay_s": 2, "downscale_delay_s": 30, "look_back_period_s": 4,
                   "metrics_interval_s": 1}
    router = None
    if kv_policy:  # spyre_serve's KV policy, and its KV router to spread the long requests
        # Half the capacity: a running request grows to about twice what it holds mid-way.
        autoscaling["policy"] = {"policy_function": KV_POLICY,
                                 "policy_kwargs": {"target_kv_utilization": 0.5}}
        router = {"request_router_class": "spyre_serve.serve.kv_routing:KVCapacityRouter",
                  "request_routing_stats_period_s": 0.2}
    return AppArgs(model=tiny_model, served_model_name="tiny", max_model_len=256,
                   max_num_seqs=4, replica_num_cpus=0.5,
                   engine_kwargs={"num_gpu_blocks_override": BLOCKS},
                   # Fake nodes share this machine's disk: each keeps its own compile cache,
                   # so only the warm-start catalog can make a new node warm.
                   spyre={"card_memory_bytes": 256 * MiB,
                          "compile_cache_dir": str(compile_cache / "{node_id}")},
                   autoscaling_config=autoscaling, request_router_config=router)


def print_cluster_state(ray) -> None:
    """What a failed wait on the autoscaler needs: each node's resources in use, the
    placement groups, the live actors and the autoscaler's own view."""
    import subprocess
    for n in ray.nodes():
        if n["Alive"]:
            print("node", n["NodeID"][:8], {k: v for k, v in n["Resources"].items()
                                             if not k.startswith("node:")})
    print("resources available:", ray.available_resources())
    print("placement groups:", {k[:8]: (v["state"], {i: n[:8] for i, n in
                                                     v["bundles_to_node_id"].items()})
                                for k, v in ray.util.placement_group_table().items()})
    try:
        from ray.util.state import list_actors
        print("live actors:", [(a.class_name, a.node_id[:8], a.pid) for a in
                               list_actors(filters=[("state", "=", "ALIVE")])])
    except Exception as e:  # noqa: BLE001 - the state API needs the dashboard
        print("live actors unknown:", e)
    status = subprocess.run([str(Path(sys.executable).parent / "ray"), "status", "-v",
                             f"--address={ray.get_runtime_context().gcs_address}"],
                            capture_output=True, text=True, timeout=60,
                            env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    print("ray status -v:", status.stdout[-4000:], status.stderr[-2000:])


def print_replica_deaths(app_name: str) -> None:
    """Why a replica of the app is gone, as Ray's state API recorded it."""
    try:
        from ray.util.state import list_actors
        for a in list_actors(filters=[("class_name", "=", f"ServeReplica:{app_name}:SpyreLLM")],
                             detail=True):
            print("replica actor", a.name, a.state, a.node_id[:8], a.death_cause)
    except Exception as e:  # noqa: BLE001 - the state API needs the dashboard
        print("replica deaths unknown:", e)


def worker_nodes(ray) -> list[str]:
    return [n["NodeID"] for n in ray.nodes()
            if n["Alive"] and n["Resources"].get("spyre", 0) > 0]


def replica_states(serve, app_name: str) -> dict[str, int]:
    app = serve.status().applications.get(app_name)
    if app is not None and app.status == "DEPLOY_FAILED":
        # Serve would keep retrying; the cause is in the message.
        raise AssertionError(f"{app_name} failed to deploy: {app.message}")
    if app is None or "SpyreLLM" not in app.deployments:
        return {}
    return dict(app.deployments["SpyreLLM"].replica_states)


def running_replicas(serve, app_name: str) -> int:
    return replica_states(serve, app_name).get("RUNNING", 0)


def spyre_groups(ray, *states: str) -> list[str]:
    return [pg_id for pg_id, pg in ray.util.placement_group_table().items()
            if pg["state"] in states and any("spyre" in b for b in pg["bundles"].values())]


class Load:
    """Keeps `concurrency` long completions in flight until stopped; counts, per replica, the
    client completions each one answered (the `x-spyre-replica` response header), so a
    replica's own startup request can never pass for client traffic."""

    def __init__(self, app_url: str, concurrency: int):
        self.app_url, self.stop_event = app_url, threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True)
                        for i in range(concurrency)]
        self.by_replica: Counter[str] = Counter()
        self.ended = [0] * concurrency  # requests each thread has seen end, either way
        self.failures: list[str] = []

    def _run(self, thread: int):
        with httpx.Client(timeout=300) as client:
            while not self.stop_event.is_set():
                r = client.post(f"{self.app_url}/v1/completions", json={
                    "model": "tiny", "prompt": PROMPT, "max_tokens": OUTPUT,
                    "ignore_eos": True, "temperature": 0})
                if r.status_code == 200 and r.json()["usage"]["completion_tokens"] == OUTPUT:
                    self.by_replica[r.headers["x-spyre-replica"]] += 1
                else:
                    self.failures.append(f"{r.status_code}: {r.text[:200]}")
                self.ended[thread] += 1

    def all_ended_since(self, ended: list[int]) -> bool:
        """Whether every request in flight when `ended` was taken has ended."""
        return all(now > then for now, then in zip(self.ended, ended))

    def start(self) -> "Load":
        for t in self.threads:
            t.start()
        return self

    def stop(self) -> None:
        self.stop_event.set()
        for t in self.threads:
            t.join(timeout=300)


@pytest.fixture(scope="module")
def apps(autoscaling_cluster, tiny_model, tmp_path_factory):
    """Both apps deployed at once; each first replica can only be placed once the
    autoscaler added a spyre node for it (the head declares none)."""
    ray, marker = autoscaling_cluster
    from ray import serve

    from deployments.openai_app import build_app
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
    cache = tmp_path_factory.mktemp("compile-cache")
    assert worker_nodes(ray) == [], "the head must declare no spyre cards"
    started = time.monotonic()
    for name, kv_policy in ((KV_APP, True), (DEFAULT_APP, False)):
        # Not serve.run, which waits for each app in turn.
        serve._run(build_app(app_args(tiny_model, cache, kv_policy)), name=name,
                   route_prefix=f"/{name}", _blocking=False)
    wait_for("both apps' first replicas", lambda: running_replicas(serve, KV_APP) == 1
             and running_replicas(serve, DEFAULT_APP) == 1, 900, 2)
    print(f"first replicas ready {time.monotonic() - started:.1f} s after serve.run")
    assert len(worker_nodes(ray)) == 2
    yield ray, serve, f"http://127.0.0.1:{port}", marker
    serve.shutdown()


def one_replica_each(serve) -> bool:
    return (replica_states(serve, KV_APP) == {"RUNNING": 1}
            and replica_states(serve, DEFAULT_APP) == {"RUNNING": 1})


# On one host every fake node shares the IP, so the EngineCore (a Ray driver of its own)
# attaches to the head's raylet: SpyreRayExecutor lifts vLLM's "driver node in the placement
# group" check, which on Spyre guards nothing (the driver touches no card).
@pytest.mark.timeout(3000)
def test_kv_policy_scales_out_a_preempting_load_that_serves_default_policy_does_not(apps):
    ray, serve, url, _ = apps
    kv_url, default_url = f"{url}/{KV_APP}", f"{url}/{DEFAULT_APP}"
    wait_for("one replica in each app", lambda: one_replica_each(serve), 600, 1)
    # Per-replica figures come from the replica actors: a status GET through the proxy is
    # routed, and the KV router sends every one to the replica with the most free blocks.
    (first_replica,) = replica_routing_stats(KV_APP)
    default_before = replica_status(default_url)["kv_cache"]["preemptions"]
    samples: list[tuple[float, dict, dict]] = []

    def sample() -> bool:
        samples.append((round(time.monotonic() - load_started, 1),
                        replica_states(serve, KV_APP), replica_states(serve, DEFAULT_APP)))
        return True

    def since_load() -> float:
        return round(time.monotonic() - load_started, 1)

    # Serve's default policy first, alone: the load for DEFAULT_LOAD_S (over 20 times
    # Serve's upscale delay, longer than the KV policy took to ask for a replica in every
    # run), during which it preempts and asks for nothing. One app's load at a time: two
    # at once on 2 cores made the KV app's new replica take 2 minutes to start.
    load_started = time.monotonic()
    default_load = Load(default_url, CONCURRENCY).start()
    try:
        wait_for(f"{DEFAULT_LOAD_S} s of the load on Serve's default policy", lambda: sample()
                 and since_load() > DEFAULT_LOAD_S, DEFAULT_LOAD_S + 60, 1)
    finally:
        default_load.stop()
    default_after = replica_status(default_url)["kv_cache"]["preemptions"]

    timeline = {}
    window: list[tuple[float, dict]] = []  # (s since load, replica: (free tokens, preempted))
    load_started = time.monotonic()
    kv_load = Load(kv_url, CONCURRENCY).start()
    try:
        wait_for("the KV policy to ask for a second replica", lambda: sample()
                 and sum(replica_states(serve, KV_APP).values()) == 2, 600, 1)
        timeline["kv_policy_asked"] = since_load()
        wait_for("the KV policy's second replica", lambda: sample()
                 and running_replicas(serve, KV_APP) == 2, 900, 1)
        timeline["second_replica_ready"] = since_load()
        on_two = replica_routing_stats(KV_APP)
        if first_replica not in on_two:
            print_replica_deaths(KV_APP)
        assert first_replica in on_two, f"the first replica is gone: {list(on_two)}"
        alone = {"preemptions": on_two[first_replica]["preemptions"],
                 "answered": kv_load.by_replica[first_replica]}
        wait_for("both replicas to answer client completions",
                 lambda: all(kv_load.by_replica[r] > 0 for r in on_two), 300, 0.5)
        timeline["both_served"] = since_load()
        in_flight = list(kv_load.ended)
        wait_for("the requests the first replica took alone to end",
                 lambda: kv_load.all_ended_since(in_flight), 300, 0.2)
        timeline["hand_over_ended"] = since_load()
        # On two replicas (and the KV router) the four long requests have room.
        on_two = replica_routing_stats(KV_APP)
        answered = Counter(kv_load.by_replica)

        def window_sample() -> bool:
            window.append((since_load(), {r[:4]: (int(s["free_kv_tokens"]), int(s["preemptions"]))
                                          for r, s in replica_routing_stats(KV_APP).items()}))
            return True

        wait_for(f"each KV replica to answer {ON_TWO_WINDOW} more completions", lambda:
                 window_sample() and all(kv_load.by_replica[r] - answered[r] >= ON_TWO_WINDOW
                                         for r in on_two), 600, 0.25)
        after = replica_routing_stats(KV_APP)
        answered_on_two = sum(kv_load.by_replica[r] - answered[r] for r in on_two)
    finally:
        kv_load.stop()
        print("autoscale-up timeline (s since the KV app's load began):", timeline)
        print("replica states when they changed (s since a load began, KV policy, Serve's "
              "default):", [x for i, x in enumerate(samples)
                            if i == 0 or x[1:] != samples[i - 1][1:]])
        print("client completions per replica:", dict(kv_load.by_replica),
              dict(default_load.by_replica))
        print("in the window (s since load, replica: (free KV tokens, preempted)):", window)
    assert not kv_load.failures and not default_load.failures, \
        (kv_load.failures[:3], default_load.failures[:3])
    assert set(after) == set(on_two), "a replica was replaced while the load ran"
    assert first_replica in after, f"the first replica is gone: {list(after)}"
    (second_replica,) = set(after) - {first_replica}
    preempted_on_two = sum(after[r]["preemptions"] - on_two[r]["preemptions"] for r in after)
    rate_alone = alone["preemptions"] / max(1, alone["answered"])
    rate_on_two = preempted_on_two / answered_on_two
    print(f"preemptions per completion: KV policy's first replica alone {rate_alone:.2f} "
          f"({alone}), on two replicas {rate_on_two:.2f} ({preempted_on_two} in "
          f"{answered_on_two}); default policy {default_after - default_before} preemptions "
          f"in {DEFAULT_LOAD_S} s")
    assert alone["preemptions"] > 0, "the load never made the single replica preempt"
    # Measured 0.20 -> 0.05, 0.12 -> 0, 0.18 -> 0 and 0.17 -> 0.10 per completion, and,
    # before the router counted the requests sent since its figures, 0.25 -> 0.25 and
    # 0.21 -> 0.28 (the load swinging between the replicas: "in the window" shows it).
    # Asserted: lower, over ON_TWO_WINDOW completions per replica after the hand-over.
    assert rate_on_two < rate_alone
    # Serve's default policy, same load, same time: it preempted and never asked for more.
    assert default_after - default_before > 0
    assert {tuple(sorted(d.items())) for _, _, d in samples} == {(("RUNNING", 1),)}

    # The new replica sized its own cards: its status carries its own handshake. Both idle
    # now, so the KV router sends the status GETs to either.
    statuses = replica_statuses(kv_url, 2)
    assert set(statuses) == set(after)
    cold, warm = statuses[first_replica], statuses[second_replica]
    for s in (cold, warm):
        assert [r["rank"] for r in s["reports"]] == [0]
        assert s["reports"][0]["memory_budget_bytes"] == 256 * MiB
        assert s["num_blocks"] == BLOCKS <= s["reports"][0]["num_blocks"]
    assert cold["placement_group"] != warm["placement_group"]
    # Warm start: a first replica compiled and filled the cluster's catalog; the one on the
    # new node loaded its programs from there and compiled nothing, then reported afresh.
    key = cold["warm_start"]["key"]
    warmups = {name: (s["warm_start"]["state"], s["reports"][0]["warmup_seconds"],
                      s["ranks"][0]["warmup"]["compile_cache"]) for name, s in
               (("first", cold), ("second", warm))}
    print("warmups (state, seconds, compile cache):", warmups)
    assert warm["warm_start"]["state"] == f"warm (catalog {key})"
    assert warm["ranks"][0]["warmup"]["compile_cache"]["misses"] == 0
    assert warm["ranks"][0]["warmup"]["compile_cache"]["hits"] > 0
    if cold["warm_start"]["state"] == "cold":  # the other app's first replica may have won
        assert cold["ranks"][0]["warmup"]["compile_cache"]["misses"] > 0
        assert warm["reports"][0]["warmup_seconds"] < cold["reports"][0]["warmup_seconds"]

    load_stopped, down = time.monotonic(), {}
    wait_for("the KV policy to scale back to one replica",
             lambda: replica_states(serve, KV_APP) == {"RUNNING": 1}, 300, 1)
    down["one_replica"] = time.monotonic() - load_stopped
    try:
        wait_for("the autoscaler to remove the idle node", lambda: len(worker_nodes(ray)) == 2,
                 300, 1)
    except AssertionError:
        print_cluster_state(ray)
        raise
    down["idle_node_removed"] = time.monotonic() - load_stopped
    print("scale-down timeline (s since load stopped):", down)
    response = httpx.post(f"{kv_url}/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": "after scale down", "max_tokens": 2})
    assert response.status_code == 200


class Stream:
    """One streamed completion in a thread: its tokens, how it ended and when."""

    def __init__(self, app_url: str, max_tokens: int):
        self.app_url, self.max_tokens = app_url, max_tokens
        self.tokens, self.finish_reason, self.error, self.ended_at = 0, None, None, None
        self.responded = threading.Event()  # the response headers came
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        body = {"model": "tiny", "prompt": "lose the node", "max_tokens": self.max_tokens,
                "ignore_eos": True, "temperature": 0, "stream": True}
        try:
            with httpx.stream("POST", f"{self.app_url}/v1/completions", json=body,
                              timeout=httpx.Timeout(30, read=300)) as r:
                self.responded.set()
                if r.status_code != 200:
                    self.error = f"HTTP {r.status_code}"
                    return
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[len("data: "):])
                    if "error" in event:
                        self.error = f"error event: {event['error']}"
                        return
                    self.tokens += 1
                    self.finish_reason = event["choices"][0]["finish_reason"] or self.finish_reason
        except httpx.HTTPError as e:  # the proxy closed the stream mid-way
            self.error = f"{type(e).__name__}: {e}"
        finally:
            self.ended_at = time.monotonic()


def node_processes(node_id: str) -> list[psutil.Process]:
    """One fake node: its raylet and every process under it (workers, agents, EngineCores).

    Fake nodes share the autoscaler monitor's process group, so the raylet is found by its
    `--node_id`; its children are listed while it lives (they are reparented after)."""
    raylets = [p for p in psutil.process_iter(["cmdline"])
               if f"--node_id={node_id}" in (p.info["cmdline"] or [])]
    assert len(raylets) == 1, f"expected one raylet for node {node_id}, found {raylets}"
    return raylets + raylets[0].children(recursive=True)


def title(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())[:40]
    except psutil.Error:
        return "(gone)"


def engine_processes(marker: str) -> Counter:
    """Card actors and EngineCores of this cluster: the descendants of its raylets (each
    raylet has the cluster's own temp dir on its command line).

    A card actor is known by the title Ray gives it. An EngineCore is known by where it
    sits, the multiprocessing child of a replica that is not the resource tracker: vLLM
    titles it `VLLM::EngineCore` only once it runs, and a CI run listed one still under
    its spawn command line (the cluster then looked one EngineCore short)."""
    counts: Counter[str] = Counter()
    for raylet in psutil.process_iter(["cmdline"]):
        line = " ".join(raylet.info["cmdline"] or [])
        if "raylet" not in line or marker not in line:
            continue
        try:
            children = raylet.children(recursive=True)
        except psutil.Error:
            continue
        for p in children:
            try:
                line, parent = " ".join(p.cmdline()), " ".join(p.parent().cmdline())
            except (psutil.Error, AttributeError):  # gone, or orphaned (parent None)
                continue
            if is_card_actor_process(line):
                counts["card actor"] += 1
            elif "ServeReplica" in parent and "resource_tracker" not in line:
                counts["EngineCore"] += 1
    return counts


@pytest.mark.timeout(1800)
def test_losing_the_node_under_a_replica_while_it_streams(apps):
    """In-flight streams end with an error within a bound; Serve starts a replacement, the
    autoscaler replaces the node, the new replica redoes the handshake and serves; no card
    actor, EngineCore, placement group or card lock of the lost replica is left."""
    ray, serve, url, marker = apps
    from spyre_serve.vllm_plugin.settings import node_scratch
    app_url = f"{url}/{DEFAULT_APP}"
    wait_for("one replica in each app", lambda: one_replica_each(serve), 600, 1)
    before = replica_status(app_url)
    group = ray.util.placement_group_table()[before["placement_group"]]
    (card_bundle,) = [i for i, b in group["bundles"].items() if "spyre" in b]
    lost = group["bundles_to_node_id"][card_bundle]
    # One replica per app, each with one card actor and one EngineCore.
    wait_for("one card actor and one EngineCore per replica", lambda: (
        engine_processes(marker) == {"card actor": 2, "EngineCore": 2}), 60, 1,
        describe=lambda: engine_processes(marker))
    # Listed before the streams start: the tiny model streams its 240 tokens in a few
    # seconds, and walking /proc under load could take longer than that.
    victims = node_processes(lost)
    killed = [title(p) for p in victims]

    # Three times the replica's max_num_seqs, and the kill as soon as the replica answers
    # one with its response headers, before its first token: the tiny model generates its
    # 240 tokens in a second or two, and a client on 2 busy cores can see them late and in a
    # burst (a CI run saw all of four streams end in full before the kill landed). The
    # streams beyond the first four wait in the engine's queue (or Serve's) for rounds of
    # their own, so the kill finds some unfinished however late it lands.
    streams = [Stream(app_url, 240) for _ in range(12)]
    wait_for("a stream answered", lambda: any(s.responded.is_set() for s in streams), 120,
             0.002)
    killed_at, killed_wall = time.monotonic(), time.time()
    for p in victims:
        try:
            p.kill()
        except psutil.Error:
            pass
    at_kill = [s.tokens for s in streams]

    def outcomes():
        return [(s.tokens, s.finish_reason, s.error,
                 None if s.ended_at is None else round(s.ended_at - killed_at, 1))
                for s in streams]
    # A client on 2 busy cores sees a stream late and in bursts (runs saw 224 and 240 of
    # 240 tokens reach the client only after the kill, from an engine that had finished), so
    # which streams the kill cut is not known at the kill. Asserted below: no stream hangs,
    # a stream that ends without a finish reason ends before the replacement is ready (cut
    # by the loss), and the loss hit traffic (a stream cut, or held by Serve and answered
    # by the replacement).
    wait_for("a stream to end after the kill", lambda: any(
        s.ended_at is not None and s.ended_at >= killed_at for s in streams), 120, 0.05)
    print(f"killed {len(killed)} processes of node {lost}: {killed}; tokens at the kill "
          f"{at_kill}; streams (tokens, finish, error, ended s after kill): {outcomes()}")
    # The node under the replica: its card actor died with it.
    assert any(is_card_actor_process(t) for t in killed), killed

    recovery = {}
    wait_for("Ray to mark the node dead", lambda: lost not in worker_nodes(ray), 120, 0.5)
    recovery["node_dead"] = time.monotonic() - killed_at

    def replaced():
        s = replica_status(app_url)
        return s if s and s["replica"] != before["replica"] else None
    after = wait_for("a replacement replica that serves", replaced, 900, 2)
    recovery["replacement_ready"] = time.monotonic() - killed_at
    answer = httpx.post(f"{app_url}/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": "after the node loss", "max_tokens": 4, "ignore_eos": True})
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 4
    recovery["first_success"] = time.monotonic() - killed_at
    print("recovery (s after kill):", {k: round(v, 1) for k, v in recovery.items()})
    for s in streams:
        s.thread.join(120)
    print("streams once a replacement served (tokens, finish, error, ended s after kill):",
          outcomes())
    assert all(s.ended_at is not None for s in streams), outcomes()  # none hangs
    # Held: answered in full once the node was gone, so by the replacement (a stream the
    # dead engine had finished reaches its client within about a second of the kill).
    ready, dead = (killed_at + recovery[k] for k in ("replacement_ready", "node_dead"))
    cut = [s for s in streams if s.finish_reason is None]
    held = [s for s in streams if s.finish_reason == "length" and s.ended_at >= dead]
    assert all(s.ended_at < ready for s in cut), outcomes()
    assert cut or held, f"the loss hit no stream: {outcomes()}"

    # A new node, and a handshake of its own, done after the loss.
    new_group = ray.util.placement_group_table()[after["placement_group"]]
    new_node = next(new_group["bundles_to_node_id"][i] for i, b in new_group["bundles"].items()
                    if "spyre" in b)
    assert new_node != lost and new_node in worker_nodes(ray)
    assert after["num_blocks"] == BLOCKS and after["reports"][0]["created_at"] > killed_wall

    # Nothing of the lost replica is left: its group removed, one card actor and one
    # EngineCore per live replica, and the lost node's card locks free.
    wait_for("one replica in each app", lambda: one_replica_each(serve), 300, 1)
    assert ray.util.placement_group_table()[before["placement_group"]]["state"] == "REMOVED"
    assert len(spyre_groups(ray, "CREATED")) == 2 and not spyre_groups(ray, "PENDING",
                                                                        "RESCHEDULING")
    wait_for("one card actor and one EngineCore per live replica", lambda: (
        engine_processes(marker) == {"card actor": 2, "EngineCore": 2}), 120, 1,
        describe=lambda: engine_processes(marker))
    locks = list((Path(node_scratch("cards")) / lost).glob("card*.lock"))
    assert locks, "the lost node's card was never claimed through its lock"
    for lock in locks:
        with open(lock, "r+") as f:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises if a process still holds it


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-s", "-q"]))
