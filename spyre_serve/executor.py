"""Ray executor for Spyre: one actor per card, and the block-count handshake before serving.

vLLM's order is measure memory, size the KV cache, warm up. Spyre's is warm up on 4 blocks,
ask each card's compiler, size. The handshake sits where vLLM asks for available memory.
"""
from __future__ import annotations

import contextlib
import logging

import ray
import vllm.v1.executor.ray_executor as vllm_ray_executor
from vllm.v1.executor.ray_executor import RayDistributedExecutor
from vllm.v1.executor.ray_utils import RayWorkerWrapper

from spyre_serve.card import claim_card
from spyre_serve.coordinator import decide

logger = logging.getLogger(__name__)


class SpyreRayWorkerWrapper(RayWorkerWrapper):
    """Ray reports accelerator ids only for accelerators it knows; it does not know Spyre.

    So the actor claims a free card of its node itself and reports that as its device id.
    """

    def get_node_and_physical_gpu_ids(self) -> tuple[str, list[int]]:
        node_id = ray.get_runtime_context().get_node_id()
        node = next(n for n in ray.nodes() if n["NodeID"] == node_id)
        return node_id, [claim_card(node_id, int(node["Resources"].get("spyre", 0)))]


@contextlib.contextmanager
def _spyre_worker_actors():
    vllm_ray_executor.RayWorkerWrapper = SpyreRayWorkerWrapper
    try:
        yield
    finally:
        vllm_ray_executor.RayWorkerWrapper = RayWorkerWrapper


class SpyreRayExecutor(RayDistributedExecutor):
    def _init_workers_ray(self, placement_group, **ray_remote_kwargs) -> None:
        with _spyre_worker_actors():
            super()._init_workers_ray(placement_group, **ray_remote_kwargs)

    def determine_available_memory(self) -> list[int]:
        reports = self.collective_rpc("warm_up_and_report")
        decision = decide(reports, self.vllm_config.model_config.max_model_len,
                          self.vllm_config.cache_config.num_gpu_blocks_override)
        self.collective_rpc("accept_resize", args=(decision.to_dict(),))
        # vLLM turns bytes back into blocks per rank: hand it exactly the decided count.
        return [decision.num_blocks * r["bytes_per_block"] for r in reports]
