"""The compiler block report: how many KV blocks one card can hold after warmup.

One JSON file per card, written atomically by the card's compiler (real or simulated)
and read back by the worker that owns the card. Anything wrong with it is a startup
error that names the file and says how to fix it.
"""
from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

SCHEMA = 1
BLOCK_SIZE = 64
SOURCES = ("compiler", "simulated", "formula")


class ReportError(RuntimeError):
    """A block report is missing, corrupt, stale or inconsistent."""


@dataclass(frozen=True)
class BlockReport:
    device: str
    rank: int
    num_blocks: int
    model: str
    max_model_len: int
    source: str
    created_at: float
    block_size: int = BLOCK_SIZE
    schema: int = SCHEMA
    # How the simulated compiler reached num_blocks; empty for a real compiler.
    memory_budget_bytes: int = 0
    weights_bytes: int = 0
    activation_peak_bytes: int = 0
    bytes_per_block: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


def report_path(report_dir: str | os.PathLike, device: str) -> Path:
    return Path(report_dir) / f"{device}.json"


def write_report(path: Path, report: BlockReport) -> None:
    """Write atomically, so a reader never sees half a report."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        json.dump(report.to_dict(), f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def read_report(path: Path, *, device: str, rank: int, model: str, max_model_len: int,
                not_before: float) -> BlockReport:
    """Read and validate the report the compiler wrote for this card and this warmup."""
    fix = (f"Delete {path} and restart the replica so the card's compiler writes it again; "
           "if it keeps failing, the compiler on that card is broken.")
    try:
        raw = path.read_text()
    except FileNotFoundError:
        raise ReportError(f"Compiler block report {path} is missing: the compiler for card "
                          f"{device} (rank {rank}) wrote no report after warmup. {fix}") from None
    try:
        data = json.loads(raw)
        if not isinstance(data, dict):
            raise ValueError("top level is not an object")
        report = BlockReport(**data)
        if not isinstance(report.num_blocks, int) or isinstance(report.num_blocks, bool):
            raise ValueError(f"num_blocks={report.num_blocks!r} is not an integer")
    except (ValueError, TypeError) as e:
        raise ReportError(f"Compiler block report {path} is corrupt ({e}). {fix}") from None
    if report.schema != SCHEMA:
        raise ReportError(f"Compiler block report {path} has schema {report.schema}, "
                          f"this spyre_serve reads schema {SCHEMA}. Upgrade the card's compiler "
                          f"or spyre_serve so they agree.")
    if report.source not in SOURCES:
        raise ReportError(f"Compiler block report {path} is corrupt (source={report.source!r}, "
                          f"expected one of {SOURCES}). {fix}")
    if report.num_blocks < 0:
        raise ReportError(f"Compiler block report {path} is corrupt "
                          f"(num_blocks={report.num_blocks} is negative). {fix}")
    if report.block_size != BLOCK_SIZE:
        raise ReportError(f"Compiler block report {path} is for block_size={report.block_size}; "
                          f"Spyre KV blocks are {BLOCK_SIZE} tokens. {fix}")
    if report.memory_budget_bytes and report.bytes_per_block:
        room = report.memory_budget_bytes - report.weights_bytes - report.activation_peak_bytes
        # 0 blocks (a card too small) is the coordinator's to explain, with the fix.
        if report.num_blocks > 0 and report.num_blocks * report.bytes_per_block > room:
            raise ReportError(
                f"Compiler block report {path} is inconsistent: num_blocks={report.num_blocks} "
                f"of {report.bytes_per_block} bytes need {report.num_blocks * report.bytes_per_block}"
                f" bytes, but its own figures leave {room} (budget {report.memory_budget_bytes} - "
                f"weights {report.weights_bytes} - activation peak "
                f"{report.activation_peak_bytes}). {fix}")
    stale = []
    if report.device != device:
        stale.append(f"device {report.device!r} instead of {device!r}")
    if report.rank != rank:
        stale.append(f"rank {report.rank} instead of {rank}")
    if report.model != model:
        stale.append(f"model {report.model!r} instead of {model!r}")
    if report.max_model_len != max_model_len:
        stale.append(f"max_model_len {report.max_model_len} instead of {max_model_len}")
    if report.created_at < not_before:
        stale.append("written before this warmup started")
    if stale:
        raise ReportError(f"Compiler block report {path} is stale: it describes "
                          f"{', '.join(stale)}. {fix}")
    return report
