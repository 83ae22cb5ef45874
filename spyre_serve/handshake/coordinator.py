"""The block-count handshake: every rank's report in, one block count out.

Pure logic, no engine: the executor feeds it the reports its workers gathered after
warmup and broadcasts the decision back to them before the replica takes traffic.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from spyre_serve import get_logger
from spyre_serve.handshake.compiler_report import BLOCK_SIZE

logger = get_logger(__name__)

# vLLM's block pool keeps one block back as its null block: it never holds tokens.
RESERVED_BLOCKS = 1


class NotEnoughBlocks(RuntimeError):
    pass


@dataclass(frozen=True)
class Decision:
    num_blocks: int
    limiting_rank: int
    max_model_len: int
    blocks_needed: int
    override: int | None
    reports: list[dict] = field(default_factory=list)
    # Whether the cards' compiles came from the warm-start catalog, and its key.
    warm_start: dict = field(default_factory=dict)

    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - RESERVED_BLOCKS

    def to_dict(self) -> dict:
        return {**asdict(self), "usable_blocks": self.usable_blocks, "block_size": BLOCK_SIZE}


def replica_status(rank_statuses: list[dict]) -> dict:
    """The one status of a replica's handshake, from every rank's own account of it.

    Every reader (the replica's log line, `/spyre/status`, the metrics, `spyre-serve`'s
    READY line, Python callers) reads this shape: the broadcast decision, plus each rank's
    view. It also checks the broadcast was applied: each rank holds the same decision, and
    its KV tensors have exactly the decided number of blocks.
    """
    ranks = sorted(rank_statuses, key=lambda s: s["rank"])
    decision = ranks[0]["decision"]
    for rank in ranks:
        if rank["decision"] != decision:
            raise RuntimeError(f"rank {rank['rank']} holds a different handshake decision "
                               f"than rank 0: {rank['decision']} vs {decision}")
        held = {shape[0] for shape in rank["kv_cache_shapes"]}
        if held != {decision["num_blocks"]}:
            raise RuntimeError(f"rank {rank['rank']} holds KV caches of {sorted(held)} blocks; "
                               f"the coordinator broadcast {decision['num_blocks']}")
    return {**decision, "ranks": [{k: v for k, v in r.items() if k != "decision"}
                                  for r in ranks]}


def blocks_needed(max_model_len: int) -> int:
    return math.ceil(max_model_len / BLOCK_SIZE)


def report_table(reports: list[dict]) -> str:
    header = f"{'rank':>4} {'device':>8} {'num_blocks':>10} {'source':>9} {'budget MiB':>10} " \
             f"{'weights MiB':>11} {'activ. MiB':>10} {'KiB/block':>9} {'warmup s':>8}  start"
    rows = [header]
    for r in sorted(reports, key=lambda r: r["rank"]):
        rows.append(f"{r['rank']:>4} {r['device']:>8} {r['num_blocks']:>10} {r['source']:>9} "
                    f"{r['memory_budget_bytes'] / 2**20:>10.1f} {r['weights_bytes'] / 2**20:>11.1f} "
                    f"{r['activation_peak_bytes'] / 2**20:>10.1f} {r['bytes_per_block'] / 2**10:>9.1f} "
                    f"{r.get('warmup_seconds', 0):>8.1f}  {_start(r)}")
    return "\n".join(rows)


def _start(report: dict) -> str:
    start = report.get("start", "-")
    return {"warm": f"warm (catalog {report.get('catalog_key')})",
            "local": "warm (local cache)"}.get(start, start)


def decide(reports: list[dict], max_model_len: int, override: int | None = None) -> Decision:
    """Take the minimum over ranks, let an explicit override win, and check one full request fits."""
    if not reports:
        raise ValueError("no block reports to coordinate")
    ranks = sorted(r["rank"] for r in reports)
    if ranks != list(range(len(reports))):
        raise RuntimeError(f"block reports came from ranks {ranks}; expected each of "
                           f"0..{len(reports) - 1} exactly once")
    limiting = min(reports, key=lambda r: (r["num_blocks"], r["rank"]))
    logger.info("Spyre block reports:\n%s", report_table(reports))
    need = blocks_needed(max_model_len)
    if override is not None:
        if override > limiting["num_blocks"]:
            logger.warning("num_gpu_blocks_override=%d exceeds the %d blocks rank %d's card "
                           "reports it can hold; the override wins", override,
                           limiting["num_blocks"], limiting["rank"])
        logger.info("num_gpu_blocks_override=%d wins over the reported minimum %d (rank %d)",
                    override, limiting["num_blocks"], limiting["rank"])
        num_blocks, source = override, f"num_gpu_blocks_override={override}"
    else:
        num_blocks = limiting["num_blocks"]
        source = (f"rank {limiting['rank']} (card {limiting['device']}, "
                  f"{limiting['source']} report)")
    usable = num_blocks - RESERVED_BLOCKS
    if usable < need:
        available = max(0, usable)
        fits = available * BLOCK_SIZE
        raise NotEnoughBlocks(
            f"Number of pages available on Spyre {available} is not enough to serve the current "
            f"model (need at least {need} pages). The limit comes from {source}: {num_blocks} "
            f"blocks of {BLOCK_SIZE} tokens, one of which vLLM reserves, while max_model_len="
            f"{max_model_len} needs {need}. The estimated maximum model length that fits is "
            f"{fits}. Fix: {f'set max_model_len <= {fits}, ' if fits else ''}give that card "
            f"more memory (spyre.card_memory_bytes for simulated cards), or use more tensor-parallel "
            f"ranks.")
    decision = Decision(num_blocks=num_blocks, limiting_rank=limiting["rank"],
                        max_model_len=max_model_len, blocks_needed=need, override=override,
                        reports=sorted(reports, key=lambda r: r["rank"]))
    logger.info("Spyre KV cache: %d blocks of %d tokens on every rank (limited by %s)",
                num_blocks, BLOCK_SIZE, source)
    return decision
