"""SpyreWorker: one tensor-parallel rank, living in the Ray actor that owns one card."""
from __future__ import annotations

import os
import time

import torch
from vllm.v1.core.kv_cache_utils import (
    get_kv_cache_config_from_groups,
    get_kv_cache_groups,
)
from vllm.v1.worker.cpu_worker import CPUWorker

from spyre_serve.handshake import card as cards
from spyre_serve.handshake import catalog
from spyre_serve import get_logger
from spyre_serve.vllm_plugin.attention import (compile_cache_counts, compiled_graphs,
                                               install_kv_program)
from spyre_serve.vllm_compat import hook
from spyre_serve.vllm_plugin import step_channel
from spyre_serve.vllm_plugin.settings import SpyreSettings
from spyre_serve.vllm_plugin.warmup import (WARMUP_BLOCKS, release_freed_memory, run_warmup,
                                            settled_rss)

logger = get_logger(__name__)


class SpyreWorker(CPUWorker):
    def init_device(self) -> None:
        super().init_device()
        self.settings = SpyreSettings.from_vllm_config(self.vllm_config)
        visible = self.parallel_config.assigned_physical_gpu_ids
        if visible:
            os.environ["SPYRE_DEVICES"] = ",".join(str(i) for i in visible)
        devices = [int(d) for d in os.environ.get("SPYRE_DEVICES", "").split(",") if d != ""]
        index = cards.claimed_card_index()
        if index is None:
            index = devices[self.local_rank] if devices else self.local_rank
        self.card = cards.open_card(index, self.rank, self.settings)
        install_kv_program(self.card.compiler() if self.settings.compile_kv_program else None)
        self.decision: dict | None = None
        self.warmup: dict = {}
        logger.info("rank %d owns card %s (SPYRE_DEVICES=%s)", self.rank, self.card.device,
                    os.environ.get("SPYRE_DEVICES", ""))

    def load_model(self, *args, **kwargs) -> None:
        # vLLM's CPU linear layers repack their weights outside model.parameters(), so what
        # the weights take is measured as the resident memory loading added.
        before = settled_rss()
        super().load_model(*args, **kwargs)
        self.weights_bytes = max(0, settled_rss() - before)

    def _model_identity(self) -> tuple[str, int]:
        return self.model_config.model, self.model_config.max_model_len

    def card_identity(self) -> int | str:
        return self.card.identity

    def warm_up_and_report(self, catalog_key: str = "",
                           compile_artifacts: list[bytes | None] | None = None) -> dict:
        """Warm up on a 4-block cache, let the card's compiler report, return that report.

        With a catalog key, the card compiles into that key's cache directory on this node;
        with `compile_artifacts` from the warm-start catalog (one per rank) that directory is
        filled first, so warmup's compiles hit. The warmup and the report are the same as on
        a cold start.
        """
        started = time.time()
        start = "cold"
        self.card.compiler_ready()
        counted_from = compile_cache_counts()  # the compiler's own warm-up does not count
        if catalog_key and self.settings.backend == "cpu":
            import ray
            self.compile_cache_path = catalog.compile_cache_dir(
                self.settings, catalog_key, ray.get_runtime_context().get_node_id())
            # Inductor reads it whenever it looks for a program; nothing compiled before.
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = self.compile_cache_path
            mine = compile_artifacts[self.rank] if compile_artifacts else None
            if mine:
                try:
                    catalog.unpack_into(mine, self.compile_cache_path)
                    start = "warm"
                except Exception as e:  # noqa: BLE001 - bad artifacts mean compiling cold
                    logger.warning("rank %d: the catalog's compiled programs did not unpack "
                                   "(%s: %s); compiling cold", self.rank, type(e).__name__, e)
        runner = self.model_runner
        spec = runner.get_kv_cache_spec()
        if not spec:
            raise RuntimeError(
                f"rank {self.rank}: {self.model_config.model} keeps no KV cache (an encoder-only "
                "model), so the block handshake has nothing to size. spyre_serve serves decoder "
                "models: for embeddings use one with engine_kwargs runner: pooling, convert: embed")
        groups = get_kv_cache_groups(self.vllm_config, spec)
        saved_override = self.cache_config.num_gpu_blocks_override
        self.cache_config.num_gpu_blocks_override = WARMUP_BLOCKS
        try:
            warmup_config = get_kv_cache_config_from_groups(self.vllm_config, groups, 0)
        finally:
            self.cache_config.num_gpu_blocks_override = saved_override
        runner.initialize_kv_cache(warmup_config, is_profiling=True)
        warmup_shapes = sorted({tuple(t.shape) for t in runner.kv_caches})
        with torch.inference_mode():
            stats = run_warmup(runner, self.vllm_config, warmup_config)
        runner._cleanup_profiling_kv_cache()

        measured = cards.WarmupMeasurement(
            weights_bytes=self.weights_bytes, activation_peak_bytes=stats["activation_peak_bytes"],
            bytes_per_block=sum(s.page_size_bytes for s in spec.values()))
        model_name, max_model_len = self._model_identity()
        self.card.publish_block_report(model_name, max_model_len, measured)
        report = self.card.read_block_report(model_name, max_model_len, not_before=started)
        self.warmup = {"seconds": time.time() - started, "steps": stats["steps"],
                       "kv_cache_shapes": warmup_shapes, "graphs": compiled_graphs(),
                       "compile_cache": compile_cache_counts(since=counted_from),
                       "report_file": str(self.card.report_file)}
        counts = self.warmup["compile_cache"]
        if start == "cold" and counts["hits"] and not counts["misses"]:
            start = "local"  # this node's own compile cache already held every program
        return {**report.to_dict(), "bytes_per_block": measured.bytes_per_block,
                "warmup_seconds": self.warmup["seconds"], "start": start,
                "catalog_key": catalog_key}

    def compile_artifacts(self) -> bytes | None:
        """This card's compiled programs, packed for the warm-start catalog (None: nothing
        to pack, e.g. the sendnn backend, whose compiler keeps its own cache)."""
        path = getattr(self, "compile_cache_path", None)
        return catalog.pack_dir(path) if path else None

    def compile_or_warm_up_model(self):
        result = super().compile_or_warm_up_model()
        # vLLM's last start step on this rank (after the KV cache is allocated). Freeze the
        # startup heap, as vLLM's GPU worker and EngineCore do (its CPU worker lives in the
        # EngineCore, which does): otherwise every full collection while serving walks the
        # ~670k objects of torch, vLLM and the model, a ~0.4 s stall on a decode step.
        hook("vllm.utils.gc_utils:freeze_gc_heap")()
        # What loading and warmup freed goes back to the system before serving: a serving
        # card otherwise keeps it (SmolLM2's card idles at 1480 MiB PSS, against 1568).
        release_freed_memory()
        return result

    def accept_resize(self, decision: dict) -> None:
        self.decision = decision

    def initialize_from_config(self, kv_cache_config) -> None:
        if self.decision is None:
            raise RuntimeError("rank %d was asked to allocate its KV cache before the block "
                               "handshake broadcast a size" % self.rank)
        if kv_cache_config.num_blocks != self.decision["num_blocks"]:
            raise RuntimeError(
                f"rank {self.rank}: vLLM planned {kv_cache_config.num_blocks} KV blocks but the "
                f"coordinator broadcast {self.decision['num_blocks']}")
        super().initialize_from_config(kv_cache_config)

    def spyre_status(self) -> dict:
        return {
            "rank": self.rank,
            "device": self.card.device,
            "backend": self.settings.backend,
            "decision": self.decision,
            "warmup": self.warmup,
            "kv_cache_shapes": sorted({tuple(t.shape) for t in self.model_runner.kv_caches}),
            # What the card really holds, to check the compiler's bytes_per_block against.
            "kv_cache_bytes": sum(t.numel() * t.element_size()
                                  for t in self.model_runner.kv_caches),
            "graphs_now": compiled_graphs(),
            # Whether the engine sends step n+1 while this card runs step n (platform.py):
            # the field of this rank's config that its model runner is built from (the
            # runner's own copy is a private attribute with no hook to guard it).
            "async_scheduling": self.vllm_config.scheduler_config.async_scheduling,
            # Where this card's compute runs (card_actors.card_process_env sets the count).
            "torch_num_threads": torch.get_num_threads(),
            "cpu_affinity": sorted(os.sched_getaffinity(0)),
            # How the engine's steps reach this rank (step_channel.py): its socket, and the
            # steps and calls answered over it (none: Ray calls).
            "step_channel": dict(step_channel.card_end),
        }
