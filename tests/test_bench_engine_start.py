import pytest
"""README's `bench/engine_start.py --warm-start` runs and writes the figures it prints."""
import json
import os
import subprocess
import sys
from pathlib import Path

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def test_engine_start_figures(tmp_path, tiny_model):
    out = tmp_path / "engine_start.json"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own Ray
    run = subprocess.run([sys.executable, "bench/engine_start.py", "--models", "tiny", "--tp", "1",
                          "--card-memory-mib", "256", "--warm-start",
                          "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    cold, warm = json.loads(out.read_text())["results"]
    for result in (cold, warm):
        assert result["model"] == "tiny" and result["tp"] == 1
        (rank,) = result["ranks"]
        assert result["num_blocks"] == rank["reported_blocks"] > 0
        assert rank["warmup_steps"] > 0 and result["engine_start_s"] > rank["warmup_s"] > 0
        assert f"{result['num_blocks']}" in run.stdout
    # The second start found the first one's programs in the catalog and compiled nothing.
    assert cold["start"] == "cold" and cold["ranks"][0]["compile_cache"]["misses"] > 0
    assert warm["start"] == f"warm (catalog {cold['catalog_key']})"
    assert warm["ranks"][0]["compile_cache"]["misses"] == 0
    assert warm["catalog_entry_bytes"] > 0 and set(warm["targets"]) >= {"warmup <= 0.3x cold"}
    assert "warm vs cold" in run.stdout
