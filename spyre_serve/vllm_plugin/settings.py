"""Spyre settings that travel with vLLM's config (``additional_config["spyre"]``) to every rank."""
from __future__ import annotations

import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

DEFAULT_CARD_MEMORY_BYTES = 2 * 1024**3
# The Ray resource a node offers per card, one per tensor-parallel rank's bundle (the
# platform's ray_device_key).
RAY_CARD_RESOURCE = "spyre"
# A Ray node label that sets the simulated budget of every card on that node, over
# spyre.card_memory_bytes: a cluster of unlike cards (`ray start --labels
# "spyre-serve/card-memory-bytes=<bytes>"`, KubeRay rayStartParams.labels, an autoscaler
# node type's `labels`). Real cards need none: their compiler reports what they hold.
CARD_MEMORY_LABEL = "spyre-serve/card-memory-bytes"


def node_scratch(name: str) -> str:
    """$TMPDIR/spyre-serve/<name> on this node: card locks, block reports, compile caches."""
    return os.path.join(os.environ.get("TMPDIR", "/tmp"), "spyre-serve", name)


class SpyreSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    backend: Literal["cpu", "sendnn"] = Field(
        "cpu", description="cpu: simulated cards on vLLM's CPU kernels; sendnn: real cards via torch_sendnn")
    card_memory_bytes: int | list[int] = Field(
        DEFAULT_CARD_MEMORY_BYTES,
        description="Simulated card memory budget; one number for all ranks or one per TP rank")
    report_dir: str = Field(
        "", description="Where card compilers write block reports; empty: "
        "$TMPDIR/spyre-serve/reports of the node the card is on")
    compile_kv_program: bool = Field(
        True, description="Compile the card's KV-cache program (the card's compiler); off only for debugging")
    warm_start: bool = Field(
        True, description="Share compiled programs and block reports through the cluster's "
        "warm-start catalog, so the next replica with the same key compiles nothing")
    cache_uri: str = Field(
        "", description="A directory on shared storage (NFS, a PVC) for the warm-start "
        "catalog; empty: a detached Ray actor holds it (no shared filesystem needed)")
    compile_cache_dir: str = Field(
        "", description="Where each node's card compiler keeps its programs, one folder per "
        "warm-start key; `{node_id}` expands to the Ray node id (nodes that share a disk keep "
        "separate caches); empty: $TMPDIR/spyre-serve/compile-cache")
    cpu_threads_per_card: int = Field(
        0, ge=0, description="Threads each card actor computes with (OMP_NUM_THREADS of its "
        "process; a simulated card's model runs on them); 0: the node's CPUs less one (left "
        "to the replica, its EngineCore and Serve's proxy, as vLLM leaves one to its "
        "EngineCore), divided among the replica's ranks, at least one. Lower it when several "
        "replicas share a node")

    startup_id: str = Field(
        "", description="Set by spyre_serve per engine start: names the file a startup error goes to")
    card_actors: str = Field(
        "", description="Set by the Serve replica: the name prefix of the card actors it "
        "started ahead of its engine, which the executor adopts (card_actors.py)")

    @field_validator("card_memory_bytes")
    @classmethod
    def _positive(cls, v):
        for b in v if isinstance(v, list) else [v]:
            if b <= 0:
                raise ValueError(f"card memory budgets must be positive bytes, got {b}")
        return v

    def budget_for_rank(self, rank: int) -> int:
        if isinstance(self.card_memory_bytes, int):
            return self.card_memory_bytes
        if rank >= len(self.card_memory_bytes):
            raise ValueError(
                f"card_memory_bytes lists {len(self.card_memory_bytes)} budgets but rank {rank} "
                f"exists: give one budget per tensor-parallel rank, or a single number")
        return self.card_memory_bytes[rank]

    def card_budget(self, rank: int, node_labels: dict[str, str]) -> int:
        """The budget of this rank's simulated card: its node's label, else the setting."""
        value = node_labels.get(CARD_MEMORY_LABEL)
        if value is None:
            return self.budget_for_rank(rank)
        if not value.isdigit() or int(value) <= 0:
            raise ValueError(f"node label {CARD_MEMORY_LABEL}={value!r}: give the card's "
                             "memory budget as a positive number of bytes")
        return int(value)

    def threads_per_card(self, world_size: int) -> int:
        """cpu_threads_per_card, or this node's CPUs less one, shared among world_size ranks."""
        return (self.cpu_threads_per_card
                or max(1, (len(os.sched_getaffinity(0)) - 1) // world_size))

    @property
    def reports(self) -> str:
        """report_dir, or the default resolved on this node (not where the config was written)."""
        return self.report_dir or node_scratch("reports")

    def startup_error_file(self) -> str:
        return os.path.join(self.reports, f"startup-{self.startup_id}.error")

    @classmethod
    def from_vllm_config(cls, vllm_config) -> "SpyreSettings":
        return cls.model_validate((vllm_config.additional_config or {}).get("spyre", {}))
