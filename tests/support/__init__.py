"""Helpers shared by every test module: ports, bounded waits, scrapes, and process hygiene.

One copy of each, so a fix lands everywhere (tests/reliability/helpers.py re-exports them).
"""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

MiB = 2**20
ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = ROOT / ".venv" / "bin"


def wait_for(what: str, condition, timeout: float, interval: float = 0.25, describe=None):
    """Poll `condition` until it returns something truthy; fail after `timeout` seconds,
    with `describe()` in the message when the condition's own value says too little."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}; "
                                 f"last value: {value!r}"
                                 + (f"; {describe()}" if describe else ""))
        time.sleep(interval)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        s.settimeout(2)
        return s.connect_ex((host, port)) == 0


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples called `name` (whose labels include `labels`) in a scrape.

    A name the scrape does not have at all is an error, not 0: a renamed metric must fail
    the test that reads it rather than read as "nothing happened".
    """
    total, seen = 0.0, False
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                seen = True
                if all(sample.labels.get(k) == v for k, v in labels.items()):
                    total += sample.value
    if not seen:
        raise KeyError(f"no metric called {name!r} in this scrape")
    return total


def processes_mentioning(marker: str) -> list[int]:
    """Pids whose command line contains `marker` (e.g. a Ray temp dir of a test's own)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            try:
                if marker.encode() in (proc / "cmdline").read_bytes():
                    pids.append(int(proc.name))
            except OSError:
                pass
    return pids


def processes_in_sessions(sessions: set[int]) -> list[int]:
    """Pids in the given process sessions. Ray's daemons and workers keep the session of
    the command that started them (their titles are rewritten, so a marker misses them)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            try:
                if os.getsid(int(proc.name)) in sessions:
                    pids.append(int(proc.name))
            except OSError:
                pass
    return pids


def kill_processes_mentioning(marker: str, sig: int = signal.SIGKILL) -> list[int]:
    """Stop only what a test started, never `ray stop` (which stops every Ray here)."""
    pids = processes_mentioning(marker)
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    return pids


def serve_controller_running() -> bool:
    import ray
    try:
        # Serve's controller, by the name and namespace Ray Serve gives it.
        ray.get_actor("SERVE_CONTROLLER_ACTOR", namespace="serve")
        return True
    except ValueError:
        return False


class ServeInstance:
    """Ray Serve on this cluster, its proxy on 127.0.0.1:<free port>; restarted if shut down."""

    def __init__(self):
        self.port: int | None = None

    def alive(self) -> bool:
        """Serve's controller actor exists (serve.status() answers "no apps" when Serve is
        down, so it cannot tell) and our proxy port is known."""
        return self.port is not None and serve_controller_running()

    def ensure(self) -> int:
        from ray import serve
        if not self.alive():
            if serve_controller_running():
                # A Serve whose port this instance does not know (started elsewhere): its
                # proxy would not be where the tests look, so start over.
                serve.shutdown()
            self.port = free_port()
            serve.start(http_options={"host": "127.0.0.1", "port": self.port})
        return self.port

    def shutdown(self) -> None:
        from ray import serve
        if self.port is not None:
            serve.shutdown()
            self.port = None

    def drain_and_shutdown(self) -> None:
        """What `spyre-serve run` does on Ctrl-C / SIGTERM and `spyre-serve stop` does."""
        from spyre_serve.ops.shutdown import drain_and_shutdown
        drain_and_shutdown()
        self.port = None


def start_ray_head(temp_dir: Path, port: int, log: Path, *, cards: int, num_cpus: int,
                   extra: tuple[str, ...] = (), env: dict | None = None):
    """A Ray head of a test's own: spyre-serve's `ray start` command (cli.start_command) with
    `--block`, in its own temp dir and session, so SIGTERM to this one process stops this
    cluster and no other Ray on the machine. Returns the process and the GCS address."""
    import subprocess

    from ray.util import get_node_ip_address

    from spyre_serve.ops.cli import node_env, start_command
    command = start_command(cards, num_cpus, port, str(temp_dir)) + [
        "--block", "--include-dashboard=false", *extra]
    head = subprocess.Popen(command, env=node_env(env), stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    # The head binds the node IP, not 127.0.0.1.
    return head, f"{get_node_ip_address()}:{port}"


def newcomer_env(home: Path, ray_tmpdir: Path) -> dict[str, str]:
    """A newcomer's environment: an empty HOME, a Ray temp dir of our own, no Ray settings.

    PIP_CACHE_DIR stays (installs stay fast); RAY_* and the suite's own variables go.
    """
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("RAY_") and k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env.update(HOME=str(home), RAY_TMPDIR=str(ray_tmpdir), HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1")
    return env


@contextlib.contextmanager
def suite_driver_set_aside():
    """For a module that runs a Ray cluster of its own: this process's driver leaves the
    suite's cluster (and RAY_ADDRESS is put aside) and comes back afterwards, so the
    module runs in any order."""
    import ray

    from conftest import connect_driver
    previous = ray.get_runtime_context().gcs_address if ray.is_initialized() else None
    ray.shutdown()
    saved_address = os.environ.pop("RAY_ADDRESS", None)
    try:
        yield ray
    finally:
        ray.shutdown()
        if saved_address is not None:
            os.environ["RAY_ADDRESS"] = saved_address
        if previous is not None:
            connect_driver(previous)


def replica_status(app_url: str) -> dict | None:
    """/spyre/status of whichever replica Serve routes this GET to; None if none answers."""
    import httpx
    try:
        response = httpx.get(f"{app_url}/spyre/status", timeout=60)
    except httpx.HTTPError:
        return None
    return response.json() if response.status_code == 200 else None


def replica_routing_stats(app: str) -> dict[str, dict]:
    """Each replica's routing figures (free KV tokens, preemptions so far) by replica id,
    asked of its Serve replica actor the way Serve's routers ask: a GET through the proxy
    is routed, and spyre_serve's KV router sends every one to the replica with most room."""
    import ray
    prefix = f"SERVE_REPLICA::{app}#SpyreLLM#"
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith(prefix)]
    return {name[len(prefix):]: ray.get(ray.get_actor(name, namespace="serve")
                                        .record_routing_stats.remote(), timeout=60)
            for name in names}


def replica_statuses(app_url: str, replicas: int, timeout: float = 120) -> dict[str, dict]:
    """The status of each of `replicas` replicas, by replica id (GETs until all answered)."""
    seen: dict[str, dict] = {}
    wait_for(f"the status of {replicas} replicas", lambda: seen.update(
        {s["replica"]: s for s in [replica_status(app_url)] if s}) or len(seen) == replicas,
        timeout, 0.2)
    return seen
