"""Ray executor for Spyre: one actor per card, and the block-count handshake before serving.

vLLM's order is measure memory, size the KV cache, warm up. Spyre's is warm up on 4 blocks,
ask each card's compiler, size. The handshake sits where vLLM asks for available memory.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from concurrent.futures import Future

import ray
from vllm.v1.executor.ray_executor import RayDistributedExecutor
from vllm.v1.executor.ray_utils import FutureWrapper

from spyre_serve import get_logger, vllm_compat
from spyre_serve.handshake import catalog
from spyre_serve.handshake.coordinator import decide
from spyre_serve.vllm_plugin import card_actors, step_channel
from spyre_serve.vllm_plugin.settings import SpyreSettings

logger = get_logger(__name__)


def _driver_needs_no_card():
    """vLLM insists its Ray driver (the EngineCore) sits on a node of the placement group,
    because on GPUs the driver used to run rank 0. Here every rank is a card actor and the
    driver touches no card; where several raylets share one host (Ray's fake multi-node
    autoscaler, several Ray nodes on one machine) the check refuses a group that is fine."""
    return vllm_compat.replaced(
        "vllm.v1.executor.ray_executor:initialize_ray_cluster",
        lambda original: functools.partial(original, require_gpu_on_driver=False))


@contextlib.contextmanager
def _startup_errors_to_file(vllm_config):
    """vLLM's frontend only says "Engine core initialization failed"; leave it the cause."""
    try:
        yield
    except Exception as e:
        settings = SpyreSettings.from_vllm_config(vllm_config)
        if settings.startup_id:
            cause = getattr(e, "cause", None) or e  # a RayTaskError carries the rank's exception
            os.makedirs(settings.reports, exist_ok=True)
            with open(settings.startup_error_file(), "w") as f:
                f.write(f"{type(cause).__name__}: {cause}")
        raise


class _StepOnAllRanks(FutureWrapper):
    """A step's result: rank 0's output (as vLLM's compiled-graph path reads it), but only
    once every rank has finished, and failing as soon as any rank fails. Waiting on rank 0
    alone would hang when another rank dies: rank 0 then blocks in the tensor-parallel
    collective with the dead rank, and the replica would never report itself unhealthy."""

    def __init__(self, refs):
        super().__init__(refs[0])
        self._refs = refs

    def result(self, timeout=None):
        pending, output = list(self._refs), None
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=timeout)
            if not ready:
                raise TimeoutError(f"engine step not finished on {len(pending)} rank(s) "
                                   f"after {timeout} s")
            # Each get raises the failed rank's error (e.g. ActorDiedError) at once; rank
            # 0's output is read (and detached, as vLLM does) once, when it is ready.
            if ready[0] == self._refs[0]:
                output = super().result()
            else:
                ray.get(ready)
        return output


class SpyreRayExecutor(RayDistributedExecutor):
    @classmethod
    def supports_async_scheduling(cls) -> bool:
        """A step is a Ray call to each card actor, so the engine can overlap it: with
        vLLM's async scheduling the EngineCore schedules and sends step n+1 while the cards
        run step n, and the card actor finds the next step waiting in its queue instead of
        idling for a round trip (the platform keeps vLLM's choice; see platform.py). vLLM's
        own (compiled-graph) Ray executor says no; ours sends plain Ray calls instead."""
        return True

    def _init_executor(self) -> None:
        # The step channel (step_channel.py): opened at the first step, None until then
        # and where the ranks cannot have one.
        self._channel: step_channel.StepChannel | None = None
        self._channel_tried = False
        with _startup_errors_to_file(self.vllm_config), _driver_needs_no_card():
            super()._init_executor()

    def _init_workers_ray(self, placement_group, **ray_remote_kwargs) -> None:
        settings = SpyreSettings.from_vllm_config(self.vllm_config)
        ahead = settings.card_actors
        runtime_env = ray_remote_kwargs.setdefault("runtime_env", {})
        runtime_env.setdefault("env_vars", {}).update(
            card_actors.card_process_env(settings, self.parallel_config.world_size))
        with (card_actors.spyre_worker_actors(),
              card_actors.adopting(ahead, placement_group,
                                   self.parallel_config.world_size) as adopted):
            super()._init_workers_ray(placement_group, **ray_remote_kwargs)
        if adopted is not None:
            logger.info("adopted %d of %d card actors started ahead by the replica",
                        len(adopted.adopted), len(self.workers))

    def shutdown(self) -> None:
        channel, self._channel = getattr(self, "_channel", None), None
        if channel is not None:
            channel.close()
        super().shutdown()
        # Actors started ahead belong to the replica and would outlive this engine; ours
        # would end with the EngineCore anyway. Either way the cards are free after this.
        card_actors.stop(getattr(self, "workers", []))

    def determine_available_memory(self) -> list[int]:
        with _startup_errors_to_file(self.vllm_config):
            return self._block_handshake()

    def _execute_dag(self, scheduler_output, grammar_output, non_block=False):
        """One engine step on every rank: over the step channel (step_channel.py), opened
        at the first step, so the handshake and startup calls before it stay Ray calls.
        Ranks that cannot have one (another node) get ordinary Ray actor calls instead of
        vLLM's Ray compiled graph, whose reader waits by spinning (Ray's shared-memory
        channel polls with sched_yield): the EngineCore kept a whole core busy while the
        card worked, on a 2-core box the core the replica and Serve's proxy need.
        Calls from one caller to one actor run in submission order, as the ranks need."""
        if not self._channel_tried:
            self._channel_tried = True
            self._channel = step_channel.open_channel(self.workers)
        if self._channel is not None:
            future = self._channel.step_future(
                self._channel.send("step", (scheduler_output, grammar_output)))
        else:
            future = _StepOnAllRanks([
                worker.execute_model_ray.remote((scheduler_output, grammar_output))
                for worker in self.workers])
        return future if non_block else future.result()

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None, non_block=False):
        """Once the step channel is open, calls go through it too, behind the steps sent
        before them (what one queue of Ray calls per actor gave)."""
        if self._channel is None:
            return super().collective_rpc(method, timeout, args, kwargs, non_block)
        results = self._channel.call(method, args, kwargs or {}, timeout)
        if not non_block:
            return results
        future = Future()
        future.set_result(results)
        return future

    def _block_handshake(self) -> list[int]:
        """Every rank warms up and reports; the coordinator decides; the decision is
        broadcast. The warm-start catalog brings compiled programs in before warmup and
        keeps the fresh result after the decision."""
        warm = catalog.WarmStart(
            self.vllm_config, SpyreSettings.from_vllm_config(self.vllm_config),
            self.parallel_config.world_size, lambda: self.collective_rpc("card_identity"))
        reports = self.collective_rpc("warm_up_and_report", args=(warm.key, warm.artifacts()))
        decision = decide(reports, self.vllm_config.model_config.max_model_len,
                          self.vllm_config.cache_config.num_gpu_blocks_override)
        decision = dataclasses.replace(decision, warm_start=warm.record(
            reports, decision.num_blocks, lambda: self.collective_rpc("compile_artifacts")))
        self.collective_rpc("accept_resize", args=(decision.to_dict(),))
        # vLLM turns bytes back into blocks per rank: hand it exactly the decided count.
        return [decision.num_blocks * r["bytes_per_block"] for r in reports]
