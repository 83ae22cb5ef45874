"""Startup faults fail with a message naming the cause, and leave nothing running.

tests/test_compiler_report.py covers a missing, corrupt or other-model report in the
reader, and tests/test_engine_startup_faults.py a corrupt one and a too-small card at engine
level. Here: the faults the simulated compiler's drill
has no switch for, injected by `faulty_compiler` (a report for another shape, ranks that
disagree on the block size, a report written for another rank and card), then a too-small
card through Serve: the deployment ends DEPLOY_FAILED with the cause in its status, and no
card actor, placement group, `spyre` resource or engine process of it survives.
"""
from __future__ import annotations

import json
import time

import psutil
import pytest

from spyre_serve.handshake.compiler_report import BlockReport, ReportError, read_report, write_report
from spyre_serve.handshake.coordinator import decide
from spyre_serve.vllm_plugin.engine import SpyreStartupError, engine_kwargs, start_llm

from . import faulty_compiler
from .helpers import CARD, MiB, app_args, delete_app, deploy, record, wait_for, wait_for_app
from .test_rank_failure import card_actor_pids

pytestmark = pytest.mark.slow


def cluster_snapshot(ray) -> dict:
    return {"spyre_free": ray.available_resources().get("spyre", 0),
            "groups": {gid for gid, g in ray.util.placement_group_table().items()
                       if g["state"] != "REMOVED"},
            "card_actors": set(card_actor_pids()), "engines": engine_processes()}


def engine_processes() -> set[int]:
    """Engine-core processes under this test process (engines it started, and those of Serve
    replicas on its Ray node)."""
    return {p.pid for p in psutil.Process().children(recursive=True)
            if "EngineCore" in " ".join(_cmdline(p))}


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline() + [p.name()]
    except psutil.Error:
        return []


def assert_nothing_left(ray, before: dict, timeout: float = 60) -> float:
    """Back to the snapshot taken before the start: cards, groups, card actors, engines."""
    started = time.monotonic()
    left: dict = {}

    def clean():
        now = cluster_snapshot(ray)
        left.update({"spyre_free_now_vs_before": (now["spyre_free"], before["spyre_free"]),
                     "new_groups": now["groups"] - before["groups"],
                     "new_card_actors": now["card_actors"] - before["card_actors"],
                     "new_engine_processes": engine_processes() - before["engines"]})
        # >=: resources of an earlier test may still be coming back while this one runs.
        return (now["spyre_free"] >= before["spyre_free"] and not left["new_groups"]
                and not left["new_card_actors"] and not left["new_engine_processes"])
    try:
        wait_for("everything of the failed start to be gone", clean, timeout, 0.5)
    except AssertionError as e:
        raise AssertionError(f"{e}: left running: {left}") from None
    return time.monotonic() - started


FAULTS = {
    # id: (tensor-parallel size, fields the broken compiler writes per rank, words expected)
    "other_shape": (1, {0: {"max_model_len": 512}},
                    ["ReportError", "is stale", "max_model_len 512 instead of 256"]),
    # Rank 0 reports 64-token blocks, rank 1 32: the start must fail on rank 1's report
    # (the message names rank 1's card file, sim1), not take the minimum of mixed units.
    "ranks_disagree_on_block_size": (2, {1: {"block_size": 32}},
                                     ["ReportError", "block_size=32", "64 tokens"]),
    "report_for_another_rank_and_card": (2, {1: {"rank": 0, "device": "spyre99"}},
                                         ["ReportError", "is stale", "rank 0 instead of 1",
                                          "device 'spyre99'"]),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_bad_report_fails_the_start_naming_file_and_cause(ray_cluster, tiny_model, tmp_path,
                                                          fault):
    tp, changes, words = FAULTS[fault]
    faulty_compiler.write_faults(tmp_path, changes)
    before = cluster_snapshot(ray_cluster)
    started = time.monotonic()
    with pytest.raises(SpyreStartupError) as e:
        start_llm(engine_kwargs(
            tiny_model, tensor_parallel_size=tp, max_model_len=256, max_num_seqs=2,
            # The KV program's compile is beside the point here: skip it to save time.
            spyre={"card_memory_bytes": CARD, "report_dir": str(tmp_path),
                   "compile_kv_program": False},
            worker_extension_cls=faulty_compiler.qualname()))
    failed_s = time.monotonic() - started
    msg = str(e.value)
    bad_rank = next(iter(changes))
    for w in words:
        assert w in msg, msg
    # The message names the file of the bad rank's card, and says how to fix it.
    assert str(tmp_path) in msg and ".json" in msg and "Delete" in msg, msg
    # The bad rank wrote its report; the others may have been stopped before writing theirs.
    reports = {path: json.loads(path.read_text()) for path in tmp_path.glob("sim*.json")}
    assert 1 <= len(reports) <= tp
    # The message names the file that carries the fault, and no healthy rank's file.
    (bad_file,) = [path for path, r in reports.items()
                   if all(r.get(k) == v for k, v in changes[bad_rank].items())]
    assert str(bad_file) in msg, msg
    for path, r in reports.items():
        if path != bad_file:
            assert r["block_size"] == 64 and str(path) not in msg, (path, msg)
    cleanup_s = assert_nothing_left(ray_cluster, before)
    record(f"startup_fault[{fault}]", failed_after_s=round(failed_s, 1),
           cleaned_up_after_s=round(cleanup_s, 1), bad_rank=bad_rank, message=msg[:160])


def _report(**changes) -> BlockReport:
    base = BlockReport(device="sim0", rank=0, num_blocks=40, model="m", max_model_len=256,
                       source="simulated", created_at=time.time(),
                       memory_budget_bytes=64 * MiB, weights_bytes=8 * MiB,
                       activation_peak_bytes=4 * MiB, bytes_per_block=1 * MiB)
    return BlockReport(**{**base.to_dict(), **changes})


# The budget check at its boundary: 64 MiB - 8 MiB weights - 4 MiB activations leaves room
# for exactly 52 blocks of 1 MiB. 52 must pass and 53 must not, so neither test can pass by
# a check that accepts or refuses everything.
ROOM = (64 - 8 - 4) * MiB // (1 * MiB)


def _read_and_decide(path):
    report = read_report(path, device="sim0", rank=0, model="m", max_model_len=256,
                         not_before=0)
    return decide([{**report.to_dict(), "bytes_per_block": report.bytes_per_block}], 256)


def test_report_filling_its_budget_exactly_is_accepted(tmp_path):
    path = tmp_path / "sim0.json"
    write_report(path, _report(num_blocks=ROOM))
    decision = _read_and_decide(path)
    assert (decision.num_blocks, decision.limiting_rank) == (ROOM, 0)


@pytest.mark.parametrize("claimed", [ROOM + 1, 10_000])
def test_report_claiming_more_blocks_than_its_budget_is_refused(tmp_path, claimed):
    """Was a bug (the report was accepted); compiler_report.read_report refuses it now."""
    path = tmp_path / "sim0.json"
    write_report(path, _report(num_blocks=claimed))
    with pytest.raises((ReportError, RuntimeError)) as e:
        _read_and_decide(path)
    assert str(claimed) in str(e.value) and str(path) in str(e.value)


def test_too_small_card_through_serve_fails_the_deployment_and_frees_everything(
        ray_cluster, serve_instance, tiny_model):
    name = "rel-too-small"
    # Rank 1's card is far too small; rank 0's is fine: the min rule makes rank 1 the limit.
    args = app_args(tiny_model, tensor_parallel_size=2, spyre={"card_memory_bytes": [CARD, 2 * MiB]})
    before = cluster_snapshot(ray_cluster)
    started = time.monotonic()
    # One attempt: Serve's default retries the constructor 3 times per replica, each a warmup.
    deploy(serve_instance, name, args, wait=False, max_constructor_retry_count=1)
    try:
        try:
            status = wait_for_app(name, "DEPLOY_FAILED", 300)
            failed_s = time.monotonic() - started
            cleanup_s = assert_nothing_left(ray_cluster, before, timeout=90)
        except AssertionError as e:
            pytest.fail(str(e))  # not a wrong message: the deployment never failed, or leaked
        message = status.deployments["SpyreLLM"].message
        cause = message[message.find("SpyreStartupError"):]
        record("startup_fault[serve_too_small_card]", deploy_failed_after_s=round(failed_s, 1),
               cleaned_up_after_s=round(cleanup_s, 1), status_message=cause[:220])
        for words in ("NotEnoughBlocks", "is not enough to serve the current model",
                      "need at least 4 pages", "rank 1 (card sim", "card_memory_bytes"):
            assert words in message, cause[:600]
    finally:
        delete_app(name)
