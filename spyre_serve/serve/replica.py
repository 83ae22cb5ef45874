"""The Serve replica: one vLLM engine on its own Spyre cards, serving the OpenAI API.

Serve gives each replica a placement group (bundle 0 for this actor, one {"spyre": 1}
bundle per TP rank) and captures child tasks into it. vLLM reads that placement group when
it builds its config inside this actor and hands it to the EngineCore subprocess, whose Ray
executor puts one card actor in each spyre bundle. The constructor returns only after
the block handshake, so Serve routes nothing to a replica whose KV cache is not sized.
"""
from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import time

import ray
from ray import serve

from spyre_serve.serve.app_args import AppArgs

logger = logging.getLogger(__name__)


def resolve_model_once_per_node(model: str) -> str:
    """Build a builtin model at most once per node, even when replicas start together."""
    from spyre_serve.ops.models import CACHE_DIR, resolve
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    with open(CACHE_DIR / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return resolve(model)


@serve.deployment(name="SpyreLLM")
@serve.ingress()
class SpyreLLMServer:
    async def __init__(self, app_args: dict):
        started = time.monotonic()
        self.args = AppArgs.model_validate(app_args)
        # First, before this process imports vLLM: the card actors' processes import vLLM
        # and set up their compiler while this replica and then its EngineCore import it
        # (card_actors.py), instead of after them; and the warm-start catalog's actor
        # starts before the handshake asks it.
        from spyre_serve.vllm_plugin.card_actors import CardActorsAhead
        self.cards_ahead = CardActorsAhead(self.args.tensor_parallel_size, self.args.spyre)
        from spyre_serve.handshake.catalog import start_catalog_ahead
        start_catalog_ahead(self.args.spyre)
        from spyre_serve.handshake.coordinator import replica_status
        from spyre_serve.vllm_plugin.engine import engine_kwargs, start_async_engine
        from spyre_serve.serve.openai_api import build_openai_app
        from spyre_serve.serve.metrics import LatestSchedulerStats, ReplicaMetrics, warmup_figures

        self.replica_id = serve.get_replica_context().replica_id.unique_id
        # The EngineCore is a subprocess and a Ray driver of its own: point it at our cluster.
        os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
        # vLLM stops its EngineCore with SIGTERM on every normal shutdown, and Ray's failure
        # signal handler (installed in every Ray driver) would print a crash-like stack dump
        # for it. A real EngineCore crash is still reported by vLLM, with its exit code.
        os.environ["RAY_DISABLE_FAILURE_SIGNAL_HANDLER"] = "1"
        model_path = await asyncio.to_thread(resolve_model_once_per_node, self.args.model)
        kwargs = engine_kwargs(**self.args.engine_kwargs_for(model_path),
                               card_actors=self.cards_ahead.prefix)
        self.latest_stats = LatestSchedulerStats()
        try:
            # In a thread, so this actor keeps answering Ray while the cards warm up.
            self.engine = await asyncio.wait_for(
                asyncio.to_thread(start_async_engine, kwargs, stat_loggers=[self.latest_stats]),
                self.args.engine_start_timeout_s)
        except BaseException as e:
            self.cards_ahead.kill()
            if isinstance(e, TimeoutError):
                raise RuntimeError(
                    f"the engine did not finish loading, warming up and sizing its KV cache "
                    f"within engine_start_timeout_s={self.args.engine_start_timeout_s}; raise "
                    "it for slow compiles") from None
            raise
        self.handshake = replica_status(await self.engine.collective_rpc("spyre_status"))
        self.first_request_seconds = await self._first_request()
        self.metrics = ReplicaMetrics(self.replica_id, self.args.model_name, self.kv_blocks,
                                      warmup_figures(self.handshake))
        self.api = await build_openai_app(
            self.engine, kwargs, self.args.frontend_options(), status=self.status,
            metrics=self.metrics.exposition, replica_id=self.replica_id,
            stream_batching_interval_s=self.args.stream_batching_interval_ms / 1000)
        # As `vllm serve` does once started: freeze the startup heap (torch, vLLM, Ray, the
        # app), so a full collection while streaming does not walk it: unfrozen it stalled
        # every stream of this replica ~0.4 s each time.
        from spyre_serve.vllm_compat import hook
        hook("vllm.utils.gc_utils:freeze_gc_heap")()
        self.ready_seconds = time.monotonic() - started
        logger.info("replica %s ready in %.1f s: %d KV blocks of %d tokens per card "
                    "(limited by rank %d); cards started %s", self.replica_id,
                    self.ready_seconds, self.handshake["num_blocks"],
                    self.handshake["block_size"], self.handshake["limiting_rank"],
                    self.handshake["warm_start"].get("state", "cold"))

    async def _first_request(self) -> float:
        """One request through the serving path before Serve routes any.

        Warmup drives each rank directly; the first step through the engine's own path
        (scheduler, executor, detokenizer) would otherwise land on a client.
        """
        from vllm import PoolingParams, SamplingParams
        started = time.monotonic()
        prompt, request_id = {"prompt_token_ids": [1, 2, 3, 4]}, f"spyre-first-{self.replica_id}"
        tasks = await self.engine.get_supported_tasks()
        if "generate" in tasks:
            params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
            outputs = self.engine.generate(prompt, params, request_id=request_id)
        else:  # a pooling model (embeddings): one prefill through its pooler
            pooling = next(t for t in tasks if t in ("embed", "classify", "score",
                                                      "token_embed", "token_classify"))
            outputs = self.engine.encode(prompt, PoolingParams(task=pooling), request_id)
        async for _ in outputs:
            pass
        return time.monotonic() - started

    def __serve_build_asgi_app__(self):
        return self.api

    def kv_blocks(self) -> dict:
        from spyre_serve.serve.metrics import kv_blocks
        return kv_blocks(self.handshake["num_blocks"], self.handshake["usable_blocks"],
                         self.latest_stats)

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's autoscaler asks every metrics interval: KV demand against capacity, for
        spyre_serve.serve.kv_autoscaling.KVCapacityPolicy (ignored by Serve's default policy)."""
        from spyre_serve.serve.kv_autoscaling import autoscaling_stats
        now, preemptions = time.monotonic(), self.latest_stats.preemptions
        last_time, last_preemptions = getattr(self, "_last_preemptions", (now, preemptions))
        self._last_preemptions = (now, preemptions)
        rate = (preemptions - last_preemptions) / (now - last_time) if now > last_time else 0.0
        kv = self.kv_blocks()
        return autoscaling_stats(kv["used_blocks"], kv["usable_blocks"],
                                 self.handshake["block_size"], kv["running_requests"],
                                 kv["waiting_requests"], rate)

    def record_routing_stats(self) -> dict[str, float]:
        """Serve's routers ask every request_routing_stats_period_s: free KV tokens, for
        spyre_serve.serve.kv_routing.KVCapacityRouter (ignored by Serve's default router)."""
        from spyre_serve.serve.kv_autoscaling import kv_demand_tokens
        from spyre_serve.serve.kv_routing import routing_stats
        kv, block_size = self.kv_blocks(), self.handshake["block_size"]
        demand = kv_demand_tokens(kv["used_blocks"], block_size, kv["running_requests"],
                                  kv["waiting_requests"])
        # With the preemptions so far: what a replica short of blocks shows, and for an
        # operator (or a test) a per-replica figure that needs no routed request.
        return {**routing_stats(kv["usable_blocks"], block_size, demand,
                                self.handshake["blocks_needed"],
                                kv["running_requests"] + kv["waiting_requests"]),
                "preemptions": float(kv["preemptions"])}

    async def status(self) -> dict:
        from spyre_serve.handshake.coordinator import replica_status
        # Asked again each time: the live KV shapes show what each card really holds.
        live = replica_status(await self.engine.collective_rpc("spyre_status"))
        group = ray.util.get_current_placement_group()
        return {"replica": self.replica_id, "model": self.args.model_name,
                "placement_group": group.id.hex() if group else None,
                "ready_seconds": self.ready_seconds,
                "first_request_seconds": self.first_request_seconds, "kv_cache": self.kv_blocks(), **live}

    async def check_health(self) -> None:
        """Serve replaces the replica when this raises, e.g. once the EngineCore died."""
        await self.engine.check_health()

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            with contextlib.suppress(Exception):
                engine.shutdown()
