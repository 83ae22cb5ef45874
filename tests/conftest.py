import os
import signal
import subprocess
import tempfile
from pathlib import Path

import pytest

# Engine processes spawn; tests must never reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Deterministic auth whatever ~/.ray holds: the suite's clusters run without Ray's token
# auth, as spyre-serve's do by default (test_readme_commands covers the token mode).
os.environ["RAY_AUTH_MODE"] = "disabled"
os.environ.pop("RAY_ADDRESS", None)  # never attach to a Ray this suite did not start

SUITE_CARDS = 8



@pytest.fixture(scope="session")
def tiny_model() -> str:
    from spyre_serve.ops.models import tiny_llama
    return str(tiny_llama())


@pytest.fixture(scope="session")
def suite_cluster():
    """One local Ray node with 8 simulated cards for the whole run, in a temp dir of its own.

    A `ray start --block` child, not `ray.init()`: a test that needs a Ray driver of its own
    (the autoscaling test) can disconnect and the next test reconnects; SIGTERM to this one
    process stops this cluster and no other Ray on the machine.
    """
    from spyre_serve.ops.cli import tool
    from support import free_port, start_ray_head, wait_for
    root = Path(tempfile.mkdtemp(prefix="rt-", dir="/tmp"))  # short: Ray's socket paths
    head, address = start_ray_head(root, free_port(), root.parent / f"{root.name}.log",
                                   cards=SUITE_CARDS, num_cpus=8)

    def connects() -> bool:
        assert head.poll() is None, (root.parent / f"{root.name}.log").read_text()[-3000:]
        return subprocess.run([tool("ray"), "status", f"--address={address}"],
                              capture_output=True).returncode == 0
    wait_for("the suite's Ray head", connects, 120, 1)
    yield address
    import ray
    ray.shutdown()
    # As `spyre-serve stop` does: drain Serve and end the catalog actor, so the head's own
    # SIGTERM drain finds its node idle instead of waiting out its 30 s.
    from spyre_serve.ops.shutdown import drain_cluster
    drain_cluster(address, head_stops=True)
    head.send_signal(signal.SIGTERM)
    try:
        head.wait(120)
    except subprocess.TimeoutExpired:
        head.kill()


@pytest.fixture(scope="session")
def ray_cluster(suite_cluster):
    """This process's Ray driver, on the suite's cluster.

    A module that needs a driver of its own (test_autoscaling) puts this one back after it.
    """
    import ray
    connect_driver(suite_cluster)
    yield ray
    os.environ.pop("RAY_ADDRESS", None)


@pytest.fixture(scope="session")
def serve_instance(ray_cluster):
    """The suite's one Ray Serve (its proxy on 127.0.0.1:<free port>): every module runs its
    apps under their own names here, so modules can run in any order next to each other."""
    from support import ServeInstance
    instance = ServeInstance()
    instance.ensure()
    yield instance
    instance.shutdown()


def connect_driver(address: str) -> None:
    import ray
    if ray.is_initialized():
        ray.shutdown()
    ray.init(address=address, log_to_driver=False)
    # The EngineCore of an in-process engine is a Ray driver of its own: it finds us here.
    os.environ["RAY_ADDRESS"] = address


def shutdown_llm(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
