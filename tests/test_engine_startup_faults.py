"""Startup faults fail with a message naming the cause, and leave nothing running."""
import time

import pytest

from reliability import faulty_compiler
from support import MiB
from spyre_serve.vllm_plugin.engine import SpyreStartupError, engine_kwargs, start_llm

pytestmark = pytest.mark.slow


def assert_nothing_left(ray, timeout=60):
    """Every card is free again and no placement group of the failed engine survives it."""
    deadline = time.monotonic() + timeout
    while True:
        free = ray.available_resources().get("spyre", 0)
        groups = [g for g in ray.util.placement_group_table().values()
                  if g["state"] != "REMOVED"]
        if free == ray.cluster_resources()["spyre"] and not groups:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"left running: {free} spyre free; placement groups {groups}")
        time.sleep(0.5)


def start(tiny_model, tp=1, extra=None, **spyre):
    return start_llm(engine_kwargs(tiny_model, tensor_parallel_size=tp, max_model_len=256,
                                   max_num_seqs=2, spyre={"card_memory_bytes": 64 * MiB, **spyre},
                                   **(extra or {})))


def test_card_too_small_names_the_rank_and_the_fix(ray_cluster, tiny_model):
    with pytest.raises(SpyreStartupError) as e:
        start(tiny_model, tp=2, card_memory_bytes=[64 * MiB, 1 * MiB])
    msg = str(e.value)
    assert "NotEnoughBlocks" in msg and "is not enough to serve the current model" in msg
    assert "need at least 4 pages" in msg and "rank 1 (card sim" in msg
    assert "card_memory_bytes" in msg
    assert_nothing_left(ray_cluster)


# One fault through the engine: the message of each kind (missing, corrupt, stale) is built
# by compiler_report.read_report and unit-tested in test_compiler_report.py, and stale reports
# go through the engine again in reliability/test_startup_faults.py. Here: that the reader's
# error, naming the file, is what the engine's start fails with.
@pytest.mark.parametrize("fault,words", [("corrupt", "is corrupt")])
def test_bad_report_names_the_file(ray_cluster, tiny_model, tmp_path, fault, words):
    faulty_compiler.write_faults(tmp_path, {0: fault})
    with pytest.raises(SpyreStartupError) as e:
        start(tiny_model, report_dir=str(tmp_path), compile_kv_program=False,
              extra={"worker_extension_cls": faulty_compiler.qualname()})
    msg = str(e.value)
    assert "ReportError" in msg and words in msg
    assert str(tmp_path / "sim") in msg and ".json" in msg
    assert_nothing_left(ray_cluster)
