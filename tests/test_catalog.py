"""The warm-start catalog's logic, without an engine: the key, entries, caps, bad entries."""
import json
import logging
import shutil
from types import SimpleNamespace

import pytest

from spyre_serve.handshake import catalog
from spyre_serve.vllm_plugin.settings import SpyreSettings


def vllm_config(model: str, **changes):
    values = {"max_model_len": 256, "max_num_seqs": 4, "block_size": 64, "dtype": "torch.float32"}
    values.update(changes)
    return SimpleNamespace(
        model_config=SimpleNamespace(model=model, max_model_len=values["max_model_len"],
                                     dtype=values["dtype"]),
        scheduler_config=SimpleNamespace(max_num_seqs=values["max_num_seqs"]),
        cache_config=SimpleNamespace(block_size=values["block_size"]))


def test_every_field_changes_the_key(tiny_model):
    card = [256 * 2**20]  # one rank's simulated card budget
    base = catalog.key_fields(vllm_config(tiny_model), SpyreSettings(), card)
    assert base["model"] == catalog.model_fingerprint(tiny_model)
    assert base["compiler"].startswith("torch ") and base["spyre_serve"]
    keys = {catalog.catalog_key(base)}
    variants = [
        catalog.key_fields(vllm_config(tiny_model, max_model_len=512), SpyreSettings(), card),
        catalog.key_fields(vllm_config(tiny_model, max_num_seqs=8), SpyreSettings(), card),
        catalog.key_fields(vllm_config(tiny_model, block_size=128), SpyreSettings(), card),
        catalog.key_fields(vllm_config(tiny_model, dtype="torch.bfloat16"), SpyreSettings(), card),
        # a card of another size (a budget set by the node's label or the setting)
        catalog.key_fields(vllm_config(tiny_model), SpyreSettings(), [2**30]),
        catalog.key_fields(vllm_config(tiny_model), SpyreSettings(), card * 2),
        catalog.key_fields(vllm_config(tiny_model), SpyreSettings(backend="sendnn"), ["spyre"]),
    ]
    for field in ("model", "compiler", "spyre_serve"):
        variants.append({**base, field: base[field] + "x"})
    for fields in variants:
        keys.add(catalog.catalog_key(fields))
    assert len(keys) == len(variants) + 1
    # The key is the same wherever it is computed.
    assert catalog.catalog_key(dict(reversed(base.items()))) == catalog.catalog_key(base)


def test_the_model_hash_follows_content_not_path(tiny_model, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(tiny_model, copy)
    assert catalog.model_fingerprint(str(copy)) == catalog.model_fingerprint(tiny_model)
    config = json.loads((copy / "config.json").read_text())
    config["num_hidden_layers"] += 1
    (copy / "config.json").write_text(json.dumps(config))
    assert catalog.model_fingerprint(str(copy)) != catalog.model_fingerprint(tiny_model)


def reports(*blocks):
    return [{"rank": r, "num_blocks": b, "bytes_per_block": 4096} for r, b in enumerate(blocks)]


def test_entries_round_trip_and_disagreement_is_found():
    entry = catalog.make_entry("k1", {"a": 1}, reports(40, 30), [b"\x00art0", None])
    assert catalog.entry_problem(entry, "k1", 2) is None
    assert catalog.artifacts_of(entry) == [b"\x00art0", None]
    assert catalog.reports_disagree(entry, reports(40, 30)) == []
    assert catalog.reports_disagree(entry, reports(40, 31)) == \
        ["rank 1: catalog 30 blocks, fresh 31"]


@pytest.mark.parametrize("damage, reason", [
    (lambda e: "not json", "not an entry"),
    (lambda e: {**e, "key": "other"}, "do not match"),
    (lambda e: {**e, "reports": e["reports"][:1]}, "a partial entry"),
    (lambda e: {**e, "artifacts": ["***", None]}, "not valid base64"),
])
def test_a_damaged_entry_is_named_and_not_used(damage, reason):
    entry = catalog.make_entry("k1", {}, reports(40, 30), [b"a", b"b"])
    assert reason in catalog.entry_problem(damage(entry), "k1", 2)


def test_the_memory_store_caps_an_entry_and_evicts_the_least_recently_used():
    small = catalog.make_entry("a", {}, reports(4), [b"x" * 100])
    size = catalog.entry_bytes(small)
    store = catalog.MemoryStore(max_entry_bytes=size * 2, max_total_bytes=size * 2 + 10)
    assert store.put("a", small).startswith("stored")
    assert store.put("b", catalog.make_entry("b", {}, reports(4), [b"y" * 100])).startswith("stored")
    assert store.get("a") is not None          # "a" is now the most recently used
    outcome = store.put("c", catalog.make_entry("c", {}, reports(4), [b"z" * 100]))
    assert "evicted b" in outcome and set(store.sizes()) == {"a", "c"}
    big = catalog.make_entry("d", {}, reports(4), [b"w" * (size * 3)])
    assert store.put("d", big).startswith("refused") and store.get("d") is None


def test_a_corrupt_directory_entry_means_a_cold_start_with_a_warning(tmp_path, caplog):
    client = catalog.CatalogClient(str(tmp_path))
    entry = catalog.make_entry("k1", {}, reports(40), [b"art"])
    client.save("k1", entry)
    assert client.fetch("k1", 1) == entry
    (tmp_path / "k1.json").write_text('{"schema": 1, "key": "k1", "repo')   # cut short
    with caplog.at_level(logging.WARNING, logger="vllm.spyre_serve.handshake.catalog"):
        assert client.fetch("k1", 1) is None
    assert "k1" in caplog.text and "ignored" in caplog.text and str(tmp_path) in caplog.text
    assert client.fetch("missing", 1) is None


def test_start_state_names_where_every_compile_came_from():
    assert catalog.start_state("k", ["warm", "warm"]) == "warm (catalog k)"
    assert catalog.start_state("k", ["warm", "local"]) == "warm (local cache)"
    assert catalog.start_state("k", ["warm", "cold"]) == "cold"
    assert catalog.start_state("", []) == "cold"
