"""The Spyre Ray executor as a Serve replica runs it.

vLLM's Ray executor insists that its driver (here the EngineCore, a subprocess of the
replica and a Ray driver of its own) sits on a node of the placement group, because on
GPUs the driver used to run rank 0. On Spyre every rank is a card actor and the driver
touches no card. Where several raylets share one host (Ray's fake multi-node autoscaler,
several Ray nodes on one big machine) a new driver attaches to the host's head raylet
whatever node the replica is on, and the check refuses a placement group that is fine.
"""
from __future__ import annotations

import contextlib
import functools

import vllm.v1.executor.ray_executor as vllm_ray_executor

from spyre_serve.executor import SpyreRayExecutor


@contextlib.contextmanager
def _driver_needs_no_card():
    original = vllm_ray_executor.initialize_ray_cluster
    vllm_ray_executor.initialize_ray_cluster = functools.partial(original,
                                                                 require_gpu_on_driver=False)
    try:
        yield
    finally:
        vllm_ray_executor.initialize_ray_cluster = original


class ServeSpyreRayExecutor(SpyreRayExecutor):
    def _init_executor(self) -> None:
        with _driver_needs_no_card():
            super()._init_executor()
