"""Graceful redeploy and shutdown: in-flight requests finish within the graceful timeout.

The drain app runs one sequence at a time, so 4 requests in flight drain one after another
over a few seconds.

1. A config update (new card budget and block count) while clients keep 4 streams
   in flight: with one replica Serve stops the old replica at once and starts the new one;
   the streams the old replica holds when it begins stopping complete in full, it drains
   within graceful_shutdown_timeout_s, and the streams sent meanwhile wait for the new
   replica and complete there.
2. Deleting an app (`serve.delete`) while 4 streams are in flight: all 4 complete in full
   and the replica drains within the graceful timeout.
3. Shutting Serve down while 4 streams are in flight, the way `spyre-serve run` does on
   Ctrl-C / SIGTERM (spyre_serve.ops.shutdown: delete the apps, then `serve.shutdown()`): all 4
   complete. Ray Serve 2.60's bare `serve.shutdown()` (what plain `serve run` does) kills
   its HTTP proxies first and cuts them.
"""
from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest

from support import port_open

from .helpers import (serve_controller_running, APP_START_TIMEOUT_S, MiB, app_args, app_status, completion_body, delete_app,
                      deploy, in_engine, metric, record, wait_for, wait_for_app)

pytestmark = pytest.mark.slow

APP = "rel-drain"
TOKENS = 64
FIRST_TOKEN: set[str] = set()  # tags of streams that received a chunk
IN_FLIGHT = 4
GRACEFUL_S = 20.0


def args_v(tiny_model, budget_mib: int, blocks: int):
    # One sequence at a time: 4 requests in flight take a few seconds to drain, one after
    # the other. A small block override keeps the engine light on a loaded machine (and, with
    # KV programs before a433602, kept decode steps from slowing down with the cache size).
    return app_args(tiny_model, max_num_seqs=1, spyre={"card_memory_bytes": budget_mib * MiB},
                    graceful_shutdown_timeout_s=GRACEFUL_S, health_check_period_s=2.0,
                    engine_kwargs={"num_gpu_blocks_override": blocks})


async def full_stream(client, tag: str, tokens: int = TOKENS) -> dict:
    started = time.monotonic()
    body = completion_body(f"drain {tag}: keep going", tokens, stream=True,
                           stream_options={"include_usage": True})
    result = {"start": started, "tag": tag}
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                result["error"] = f"http_{r.status_code}: {(await r.aread())[:200]!r}"
                return result
            events = []
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[len("data: "):]))
                    FIRST_TOKEN.add(tag)
        errors = [e["error"] for e in events if e.get("error")]
        usage = [e["usage"] for e in events if e.get("usage")]
        finish = [e["choices"][0]["finish_reason"] for e in events
                  if e.get("choices") and e["choices"][0].get("finish_reason")]
        if errors:
            result["error"] = f"error_event: {errors[0]}"
        elif finish != ["length"] or not usage or usage[-1]["completion_tokens"] != tokens:
            result["error"] = f"incomplete: finish={finish} usage={usage[-1:]}"
    except httpx.HTTPError as e:
        result["error"] = f"{type(e).__name__}: {e}"
    result["end"] = time.monotonic()
    return result


class ReplicaWatch(threading.Thread):
    """Polls Serve's view of the deployment: when did a replica start and stop stopping."""

    def __init__(self, name: str):
        super().__init__(daemon=True)
        self.name_ = name
        self.stop_event = threading.Event()
        self.stopping_from: float | None = None
        self.stopping_until: float | None = None
        self.deleting_from: float | None = None
        self.states: list[tuple[float, dict]] = []

    def run(self):
        while not self.stop_event.is_set():
            status = app_status(self.name_)
            now = time.monotonic()
            if status is not None and str(status.status).endswith("DELETING") and \
                    self.deleting_from is None:
                self.deleting_from = now
            if status is not None and "SpyreLLM" in status.deployments:
                states = {str(k): v for k, v in
                          status.deployments["SpyreLLM"].replica_states.items() if v}
                if not self.states or self.states[-1][1] != states:
                    self.states.append((now, states))
                stopping = any("STOPPING" in k for k in states)
                if stopping and self.stopping_from is None:
                    self.stopping_from = now
                if not stopping and self.stopping_from is not None and \
                        self.stopping_until is None:
                    self.stopping_until = now
            self.stop_event.wait(0.2)


@pytest.fixture(scope="module")
def _drain_app_holder(serve_instance):
    holder: dict = {}
    yield holder
    if serve_instance.alive() and app_status(APP) is not None:
        delete_app(APP)


@pytest.fixture
def drain_app(serve_instance, _drain_app_holder, tiny_model):
    """The module's app, deployed again if an earlier test shut Serve down (tests run in
    any order: the update test needs it, the Serve-shutdown test ends it)."""
    app = _drain_app_holder.get("app")
    if app is None or not serve_instance.alive() or app_status(APP) is None:
        started = time.monotonic()
        app = deploy(serve_instance, APP, args_v(tiny_model, 256, 64))
        record("redeploy", first_replica_ready_s=round(time.monotonic() - started, 1))
        _drain_app_holder["app"] = app
    return app


def test_config_update_drains_in_flight_streams(drain_app, serve_instance, tiny_model):
    from ray import serve

    from spyre_serve.serve.replica import SpyreLLMServer

    app = drain_app
    old = app.status()
    watch = ReplicaWatch(APP)
    watch.start()
    results: list[dict] = []
    new_args = args_v(tiny_model, 160, 48)

    async def run():
        done = asyncio.Event()

        async def keep_streaming(client, worker):
            n = 0
            while not done.is_set():
                results.append(await full_stream(client, f"w{worker}-{n}"))
                n += 1

        async with app.async_client(timeout=120) as client:
            workers = [asyncio.create_task(keep_streaming(client, w)) for w in range(IN_FLIGHT)]
            # Streams are queued in the engine before the update is sent.
            deadline = time.monotonic() + 60
            while in_engine((await client.get("/metrics")).text) < 2:
                assert time.monotonic() < deadline, "the streams never reached the engine"
                await asyncio.sleep(0.05)
            updated = time.monotonic()
            await asyncio.to_thread(
                serve._run, SpyreLLMServer.options(**new_args.deployment_options()).bind(
                    new_args.model_dump()), name=APP, route_prefix=f"/{APP}", _blocking=False)
            # Until the old replica has stopped (or the wait gives up).
            deadline = updated + APP_START_TIMEOUT_S + GRACEFUL_S + 60
            while watch.stopping_until is None and time.monotonic() < deadline:
                await asyncio.sleep(0.25)
            done.set()
            await asyncio.wait_for(asyncio.gather(*workers), 180)
            return updated

    updated = asyncio.run(run())
    watch.stop_event.set()
    watch.join(5)
    wait_for_app(APP, "RUNNING", 60)
    new = app.status()

    failed = [r for r in results if "error" in r]
    stopping_from, stopping_until = watch.stopping_from, watch.stopping_until
    assert stopping_from is not None and stopping_until is not None, watch.states
    drained_during_stop = [r for r in results if r["start"] < stopping_from < r.get("end", 0)]
    drain_s = stopping_until - stopping_from
    record("redeploy", requests=len(results), failures=len(failed),
           in_flight_when_old_replica_began_stopping=len(drained_during_stop),
           old_replica_drain_s=round(drain_s, 1), graceful_timeout_s=GRACEFUL_S,
           update_to_old_stopped_s=round(stopping_until - updated, 1),
           blocks_old_new=[old["num_blocks"], new["num_blocks"]])

    assert not failed, failed[:3]
    assert new["replica"] != old["replica"]
    assert new["reports"][0]["memory_budget_bytes"] == 160 * MiB
    assert (old["num_blocks"], new["num_blocks"]) == (64, 48) and new["override"] == 48
    # Streams were still running on the old replica when Serve began stopping it, and
    # they finished (above: no failure) before the graceful timeout ran out.
    assert drained_during_stop, (stopping_from, [(r["start"], r.get("end")) for r in results])
    assert drain_s < GRACEFUL_S


async def streams_across(app, stop, name: str, timing: dict, tokens: int = TOKENS,
                         all_streaming: bool = False) -> list[dict]:
    """Start IN_FLIGHT streams, call `stop` once the engine has them all, gather them."""
    async with app.async_client(timeout=120) as client:
        FIRST_TOKEN.clear()
        before_text = (await client.get("/metrics")).text
        streams = [asyncio.create_task(full_stream(client, f"{name}{i}", tokens))
                   for i in range(IN_FLIGHT)]
        deadline = time.monotonic() + 60
        if all_streaming:
            # Every stream has its first chunk (client side): all are in flight, now.
            while len(FIRST_TOKEN) < IN_FLIGHT:
                assert time.monotonic() < deadline, "the streams never all started"
                await asyncio.sleep(0.01)
        else:
            # Reached = queued, running, or already finished: the engine has seen them all.
            finished_before = metric(before_text, "vllm:request_success_total")
            while True:
                text = (await client.get("/metrics")).text
                finished = metric(text, "vllm:request_success_total") - finished_before
                if in_engine(text) + finished >= IN_FLIGHT:
                    break
                assert time.monotonic() < deadline, "the streams never all reached the engine"
                await asyncio.sleep(0.02)
        timing["stop_called"] = time.monotonic()
        stopping = asyncio.create_task(asyncio.to_thread(stop))
        results = await asyncio.wait_for(asyncio.gather(*streams), 120)
        timing["streams_done"] = time.monotonic()
        await asyncio.wait_for(stopping, 180)
        timing["stop_returned"] = time.monotonic()
    return results


def test_deleting_an_app_lets_in_flight_streams_finish(shared_app, ray_cluster):
    # The shared app of the other modules, 16 sequences at a time: 4 streams of 150 tokens
    # run together (and preempt each other on its 9 blocks) for a second or more. Its last
    # user is this module; the fixture starts it again if a later module asks for it.
    app = shared_app
    wait_for("an idle replica", app.idle_and_empty, 60)
    spyre_free_before = ray_cluster.available_resources().get("spyre", 0)
    watch = ReplicaWatch(app.name)
    watch.start()
    timing: dict = {}
    results = asyncio.run(streams_across(app, lambda: delete_app(app.name, timeout=120), "d",
                                         timing, tokens=150, all_streaming=True))
    watch.stop_event.set()
    watch.join(5)
    t0 = timing["stop_called"]
    wait_for("the replica's card to be free",
             lambda: ray_cluster.available_resources().get("spyre", 0) ==
             spyre_free_before + 1, 60)
    failed = [r for r in results if "error" in r]
    # In flight when the delete was issued (what the test controls; Serve's DELETING state
    # is only seen at the watcher's polling rate, after fast streams may be done).
    in_flight_at_stop = [r for r in results if r["start"] < t0 < r.get("end", 0)]
    record("delete_app", in_flight=len(results), failures=len(failed),
           in_flight_when_replica_began_stopping=len(in_flight_at_stop),
           last_stream_done_after_s=round(timing["streams_done"] - t0, 1),
           app_gone_after_s=round(timing["stop_returned"] - t0, 1),
           graceful_timeout_s=app.args["graceful_shutdown_timeout_s"])
    assert len(results) == IN_FLIGHT
    assert not failed, failed
    assert in_flight_at_stop, (t0, [(r["start"], r.get("end")) for r in results])
    assert timing["streams_done"] - t0 < app.args["graceful_shutdown_timeout_s"]
    assert app_status(app.name) is None


def test_serve_shutdown_lets_in_flight_streams_finish(drain_app, serve_instance, ray_cluster):
    # The drain app, on its new version since the update; the shutdown takes down
    # everything on this Serve instance.
    app = drain_app
    wait_for("an idle replica", app.idle_and_empty, 60)
    timing: dict = {}
    results = asyncio.run(streams_across(app, serve_instance.drain_and_shutdown, "s", timing))
    t0 = timing["stop_called"]
    wait_for("every card to be free after shutdown",
             lambda: ray_cluster.available_resources().get("spyre", 0) ==
             ray_cluster.cluster_resources()["spyre"], 90)
    failed = [r for r in results if "error" in r]
    record("serve_shutdown", in_flight=len(results), failures=len(failed),
           first_error=failed[0]["error"][:120] if failed else None,
           last_stream_done_after_s=round(timing["streams_done"] - t0, 1),
           shutdown_returned_after_s=round(timing["stop_returned"] - t0, 1))
    assert len(results) == IN_FLIGHT
    assert not failed, failed
    assert timing["streams_done"] - t0 < GRACEFUL_S
    # Drained, then shut down: Serve's controller is gone and its proxy port closed.
    assert not serve_controller_running()
    assert not port_open(int(app.url.split(":")[2].split("/")[0]))
