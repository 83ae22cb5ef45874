"""A card compiler that writes a damaged block report: the fault drills, on the test side.

A real compiler can fail to write its report, leave it half written, or write one for
another model, shape, block size or schema, or for another rank or card. This module is
loaded into every card actor through vLLM's `worker_extension_cls` (it adds no methods to
the worker); importing it wraps the simulated compiler so that, right after it writes its
report, the fault listed for its rank in `<report_dir>/faults.json` is applied:

    {"0": "missing"}                     rank 0's report is never written
    {"0": "corrupt"}                     rank 0's report is cut off mid-write
    {"1": {"block_size": 32}}            rank 1's compiler reports 32-token blocks
    {"0": {"__delete__": ["model"]}}     rank 0's report lacks its model field

Nothing in spyre_serve is changed: the worker reads and validates the damaged file exactly
as it would read one from a broken compiler.
"""
from __future__ import annotations

import json
from pathlib import Path

from spyre_serve.handshake import card

FAULTS_FILE = "faults.json"


def write_faults(report_dir: Path, faults: dict[int, dict | str]) -> None:
    report_dir.mkdir(parents=True, exist_ok=True)
    (report_dir / FAULTS_FILE).write_text(json.dumps({str(k): v for k, v in faults.items()}))


def _damage(report_file: Path, changes: dict | str) -> None:
    if changes == "missing":
        report_file.unlink()
        return
    if changes == "corrupt":
        report_file.write_text('{"schema": 1, "num_blocks": ')
        return
    data = json.loads(report_file.read_text())
    for key in changes.get("__delete__", []):
        data.pop(key, None)
    data.update({k: v for k, v in changes.items() if k != "__delete__"})
    report_file.write_text(json.dumps(data))


_simulated_compiler = card.SimulatedCard.publish_block_report


def _publish_then_damage(self, model, max_model_len, measured):
    _simulated_compiler(self, model, max_model_len, measured)
    spec = Path(self.settings.reports) / FAULTS_FILE
    if spec.exists():
        changes = json.loads(spec.read_text()).get(str(self.rank))
        if changes:
            _damage(self.report_file, changes)


if not getattr(card.SimulatedCard.publish_block_report, "_faulty", False):
    _publish_then_damage._faulty = True
    card.SimulatedCard.publish_block_report = _publish_then_damage


class FaultyCompiler:
    """What `worker_extension_cls` names; importing its module is the whole effect."""


def qualname(cwd: Path | None = None) -> str:
    """The dotted name card actors can import: they find modules from the driver's cwd."""
    here = Path(__file__).resolve().with_suffix("")
    root = (cwd or Path.cwd()).resolve()
    if not here.is_relative_to(root):
        raise RuntimeError(f"card actors import {here.name} from the test's working directory: "
                           f"run pytest from the repository root, not {root}")
    rel = here.relative_to(root)
    return ".".join(rel.parts) + ".FaultyCompiler"
