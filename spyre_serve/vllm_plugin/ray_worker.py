"""vLLM's Ray worker wrapper for a Spyre card: what runs inside each card actor."""
from __future__ import annotations

import ray
from vllm.v1.executor.ray_utils import RayWorkerWrapper

from spyre_serve.handshake.card import claim_card
from spyre_serve.vllm_plugin import step_channel
from spyre_serve.vllm_plugin.settings import RAY_CARD_RESOURCE


class SpyreRayWorkerWrapper(RayWorkerWrapper):
    """Ray reports accelerator ids only for accelerators it knows; it does not know Spyre.

    So the actor claims a free card of its node itself and reports that as its device id.
    Once the engine serves, its steps arrive over the step channel (step_channel.py).
    """

    def open_step_channel(self, engine_node_id: str) -> str | None:
        return step_channel.serve(self, self.rpc_rank, engine_node_id)

    def get_node_and_physical_gpu_ids(self) -> tuple[str, list[int]]:
        node_id = ray.get_runtime_context().get_node_id()
        node = next(n for n in ray.nodes() if n["NodeID"] == node_id)
        return node_id, [claim_card(node_id, int(node["Resources"].get(RAY_CARD_RESOURCE, 0)))]
