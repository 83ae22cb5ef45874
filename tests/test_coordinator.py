"""The block-count decision, without an engine."""
import pytest

from spyre_serve.handshake.coordinator import (NotEnoughBlocks, blocks_needed, decide,
                                              replica_status, report_table)


def report(rank, num_blocks, device=None):
    return {"rank": rank, "device": device or f"sim{rank}", "num_blocks": num_blocks,
            "source": "simulated", "memory_budget_bytes": 2**26, "weights_bytes": 2**20,
            "activation_peak_bytes": 2**21, "bytes_per_block": 2**16}


def test_blocks_needed_rounds_up_to_whole_64_token_blocks():
    assert blocks_needed(64) == 1
    assert blocks_needed(65) == 2
    assert blocks_needed(2048) == 32


def test_minimum_over_ranks_wins_and_names_the_rank():
    d = decide([report(0, 900), report(1, 300), report(2, 700)], max_model_len=1024)
    assert (d.num_blocks, d.limiting_rank, d.usable_blocks) == (300, 1, 299)
    assert [r["rank"] for r in d.reports] == [0, 1, 2]


def test_override_wins_over_reports():
    d = decide([report(0, 900), report(1, 300)], max_model_len=256, override=40)
    assert (d.num_blocks, d.usable_blocks) == (40, 39)  # below every report: the override


def test_one_full_length_request_must_fit_after_the_null_block():
    # 1024 tokens need 16 blocks; vLLM keeps one back, so 17 is the least that serves.
    assert decide([report(0, 17)], max_model_len=1024).num_blocks == 17
    with pytest.raises(NotEnoughBlocks) as e:
        decide([report(0, 99), report(1, 16, device="sim5")], max_model_len=1024)
    msg = str(e.value)
    assert "Number of pages available on Spyre 15 is not enough" in msg
    assert "need at least 16 pages" in msg
    assert "rank 1 (card sim5" in msg
    assert "max_model_len <= 960" in msg


def test_override_too_small_fails_naming_the_override():
    with pytest.raises(NotEnoughBlocks, match="num_gpu_blocks_override=3"):
        decide([report(0, 99)], max_model_len=256, override=3)


def test_reports_must_cover_each_rank_once():
    with pytest.raises(RuntimeError, match="expected each of 0..1"):
        decide([report(0, 9), report(0, 9)], max_model_len=64)


def test_table_has_a_row_per_rank():
    table = report_table([report(1, 5), report(0, 7)])
    lines = table.splitlines()
    assert len(lines) == 3 and lines[1].split()[0] == "0" and lines[2].split()[2] == "5"


def test_a_card_with_no_room_at_all_asks_for_memory_not_a_zero_length():
    with pytest.raises(NotEnoughBlocks) as e:
        decide([report(0, 0)], max_model_len=256)
    msg = str(e.value)
    assert "available on Spyre 0 is" in msg
    assert "max_model_len <=" not in msg and "give that card more memory" in msg


def rank_status(rank, decision, blocks):
    return {"rank": rank, "device": f"sim{rank}", "decision": decision,
            "kv_cache_shapes": [(blocks, 2, 64, 16)]}


def test_replica_status_is_the_decision_plus_each_ranks_view():
    decision = decide([report(0, 90), report(1, 30)], max_model_len=256).to_dict()
    status = replica_status([rank_status(1, decision, 30), rank_status(0, decision, 30)])
    assert (status["num_blocks"], status["usable_blocks"], status["limiting_rank"]) == (30, 29, 1)
    assert [r["rank"] for r in status["ranks"]] == [0, 1]
    assert all("decision" not in r for r in status["ranks"])


def test_replica_status_refuses_a_broadcast_that_was_not_applied():
    decision = decide([report(0, 90), report(1, 30)], max_model_len=256).to_dict()
    other = {**decision, "num_blocks": 90}
    with pytest.raises(RuntimeError, match="rank 1 holds a different handshake decision"):
        replica_status([rank_status(0, decision, 30), rank_status(1, other, 30)])
    with pytest.raises(RuntimeError, match=r"rank 1 holds KV caches of \[90\] blocks"):
        replica_status([rank_status(0, decision, 30), rank_status(1, decision, 90)])
