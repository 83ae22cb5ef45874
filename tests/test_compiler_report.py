"""The block report contract: written atomically, and every way it can be wrong is named."""
import json
import time

import pytest

from spyre_serve.handshake.compiler_report import BlockReport, ReportError, read_report, write_report

EXPECT = dict(device="sim0", rank=0, model="m", max_model_len=256)


def good(**changes):
    base = BlockReport(device="sim0", rank=0, num_blocks=42, model="m", max_model_len=256,
                       source="simulated", created_at=time.time())
    return BlockReport(**{**base.to_dict(), **changes})


def test_round_trip(tmp_path):
    path = tmp_path / "sim0.json"
    started = time.time() - 1
    write_report(path, good())
    assert read_report(path, **EXPECT, not_before=started).num_blocks == 42
    assert [p.name for p in tmp_path.iterdir()] == ["sim0.json"]  # no temp file left behind


def test_missing_names_the_file(tmp_path):
    with pytest.raises(ReportError, match=f"{tmp_path}/sim0.json is missing"):
        read_report(tmp_path / "sim0.json", **EXPECT, not_before=0)


@pytest.mark.parametrize("text", ['{"schema": 1, "num_blocks": ', "[]", '{"num_blocks": 3}',
                                  json.dumps({**good().to_dict(), "num_blocks": "many"}),
                                  json.dumps({**good().to_dict(), "num_blocks": -1}),
                                  json.dumps({**good().to_dict(), "source": "guess"})])
def test_corrupt_names_the_file(tmp_path, text):
    path = tmp_path / "sim0.json"
    path.write_text(text)
    with pytest.raises(ReportError, match=f"{path} is corrupt"):
        read_report(path, **EXPECT, not_before=0)


@pytest.mark.parametrize("changes,why", [
    ({"model": "other"}, "model 'other' instead of 'm'"),
    ({"max_model_len": 512}, "max_model_len 512 instead of 256"),
    ({"device": "sim3"}, "device 'sim3'"),
    ({"created_at": 10.0}, "written before this warmup started"),
])
def test_stale_says_what_differs(tmp_path, changes, why):
    path = tmp_path / "sim0.json"
    write_report(path, good(**changes))
    with pytest.raises(ReportError, match="is stale") as e:
        read_report(path, **EXPECT, not_before=time.time() - 60)
    assert why in str(e.value)


def test_other_block_size_or_schema_is_refused(tmp_path):
    path = tmp_path / "sim0.json"
    write_report(path, good(block_size=128))
    with pytest.raises(ReportError, match="block_size=128"):
        read_report(path, **EXPECT, not_before=0)
    write_report(path, good(schema=2))
    with pytest.raises(ReportError, match="schema 2"):
        read_report(path, **EXPECT, not_before=0)


def test_more_blocks_than_its_own_budget_allows_is_refused(tmp_path):
    path = tmp_path / "sim0.json"
    figures = dict(memory_budget_bytes=1000, weights_bytes=300, activation_peak_bytes=100,
                   bytes_per_block=100)
    write_report(path, good(num_blocks=6, **figures))  # exactly the 600 bytes left
    assert read_report(path, **EXPECT, not_before=0).num_blocks == 6
    write_report(path, good(num_blocks=7, **figures))
    with pytest.raises(ReportError, match=f"{path} is inconsistent: num_blocks=7"):
        read_report(path, **EXPECT, not_before=0)


def test_builtin_model_cache_is_keyed_by_what_built_it():
    from spyre_serve.ops.models import builder_key
    assert builder_key("tiny", 1024) == builder_key("tiny", 1024)
    assert builder_key("tiny", 1024) != builder_key("tiny", 2048)
    assert builder_key("tiny", 1024) != builder_key("smollm2")
