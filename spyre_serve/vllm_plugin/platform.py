"""SpyrePlatform: vLLM's out-of-tree platform for Spyre cards, found through the
``vllm.platform_plugins`` entry point.

On CPU builds of vLLM it is a CpuPlatform (as IBM's own plugin is), so vLLM's CPU kernels
run the simulated cards; what makes it Spyre is the Ray device key, the card env var,
64-token blocks, and our worker, executor and KV-cache program.
"""
from __future__ import annotations

import os

from vllm.platforms.cpu import CpuPlatform

from spyre_serve import get_logger, vllm_compat
from spyre_serve.handshake.card import require_backend
from spyre_serve.handshake.compiler_report import BLOCK_SIZE
from spyre_serve.vllm_plugin.settings import RAY_CARD_RESOURCE, SpyreSettings

logger = get_logger(__name__)

WORKER_CLS = "spyre_serve.vllm_plugin.worker.SpyreWorker"
DISABLE_ENV = "SPYRE_SERVE_PLATFORM"


def check_block_size(requested: int | None) -> None:
    """The one block-size rule, for every way in (engine kwargs, AppArgs, vLLM's config)."""
    if requested is not None and requested != BLOCK_SIZE:
        raise ValueError(
            f"block_size={requested} is not supported: Spyre cards hold the KV cache in fixed "
            f"{BLOCK_SIZE}-token blocks. Remove block_size from the engine arguments or set it "
            f"to {BLOCK_SIZE}.")


def register() -> str | None:
    """Entry point: active unless SPYRE_SERVE_PLATFORM=0 (e.g. to run plain vLLM beside us)."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return None
    return "spyre_serve.vllm_plugin.platform.SpyrePlatform"


class SpyrePlatform(CpuPlatform):
    device_name: str = "spyre"
    ray_device_key: str = RAY_CARD_RESOURCE
    device_control_env_var: str = "SPYRE_DEVICES"

    @classmethod
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None) -> str:
        path = super().get_attn_backend_cls(selected_backend, attn_selector_config, num_heads)
        if path.endswith(".CPUAttentionBackend"):
            return "spyre_serve.vllm_plugin.attention.SpyreCardAttentionBackend"
        return path

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        # The engine hooks are checked once per process, on the first engine config: a vLLM
        # upgrade fails here naming the hook, not deep inside a start. (Not at import: vLLM
        # loads this plugin while it is itself half imported.)
        vllm_compat.check_once(vllm_compat.ENGINE)
        settings = SpyreSettings.from_vllm_config(vllm_config)
        require_backend(settings.backend)
        cache_config = vllm_config.cache_config
        if cache_config.user_specified_block_size:
            check_block_size(cache_config.block_size)
        cache_config.block_size = BLOCK_SIZE
        cache_config.user_specified_block_size = True
        if cache_config.kv_cache_memory_bytes is None:
            # The card's compiler sizes the KV cache, not host memory; a nominal value keeps
            # the CPU worker from reserving a share of host RAM it would never use.
            cache_config.kv_cache_memory_bytes = 1
        parallel_config = vllm_config.parallel_config
        if parallel_config.worker_cls == "auto":
            parallel_config.worker_cls = WORKER_CLS
        # vLLM's CPU platform turns async scheduling off ("not required on CPU"). A card
        # actor is a Ray round trip away, which async scheduling hides (tiny model, batch
        # 1, offline: 3.17 -> 2.30 ms a step). vLLM's own decision stands: on unless the
        # user said `async_scheduling: false` or the model rules it out (pooling, some
        # speculative decoding).
        async_scheduling = vllm_config.scheduler_config.async_scheduling
        super().check_and_update_config(vllm_config)
        vllm_config.scheduler_config.async_scheduling = async_scheduling
        from spyre_serve.vllm_plugin.executor import SpyreRayExecutor
        backend = parallel_config.distributed_executor_backend
        if not (isinstance(backend, type) and issubclass(backend, SpyreRayExecutor)):
            # Cards are Ray resources held by one actor each; any other executor would run
            # ranks without a card (e.g. `vllm serve` with this plugin active).
            logger.info("Spyre runs one Ray actor per card: using SpyreRayExecutor instead of "
                        "distributed_executor_backend=%r", backend)
            parallel_config.distributed_executor_backend = SpyreRayExecutor
