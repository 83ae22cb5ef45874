import os

import pytest

# Engine processes spawn; tests must never reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

MiB = 2**20


@pytest.fixture(scope="session")
def tiny_model() -> str:
    from spyre_serve.models import tiny_llama
    return str(tiny_llama())


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray node with 8 simulated cards, shared by every engine test."""
    import ray
    ray.init(resources={"spyre": 8}, num_cpus=8, include_dashboard=False,
             log_to_driver=False)
    os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
    yield ray
    os.environ.pop("RAY_ADDRESS", None)
    ray.shutdown()


def shutdown_llm(llm) -> None:
    llm.llm_engine.engine_core.shutdown()


def pytest_collection_modifyitems(items):
    # The autoscaling test runs its own Ray cluster, so it needs a process in which no test
    # has called ray.init yet: run it first (the sort is stable, the rest keep their order).
    items.sort(key=lambda item: item.module.__name__ != "test_autoscaling")
