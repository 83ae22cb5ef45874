"""bench/roofline.py: the memory-bandwidth floor of a decode step. Engine-free."""
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import report  # noqa: E402
import roofline  # noqa: E402


def test_weights_bytes_of_the_tiny_model_match_its_loaded_tensors(tiny_model):
    tensors = {}
    for file in Path(tiny_model).glob("*.safetensors"):
        tensors.update(load_file(file))
    assert "lm_head.weight" in tensors      # untied: the input embedding is read a row a step
    expected = sum(t.numel() for name, t in tensors.items()
                   if not name.endswith("embed_tokens.weight")) * 4
    assert roofline.decode_weights_bytes(tiny_model) == expected


def test_tied_embeddings_count_once_and_untied_input_embeddings_not_at_all(tmp_path):
    embed, layer = torch.zeros(100, 8), torch.zeros(8, 8)
    save_file({"model.embed_tokens.weight": embed, "model.layers.0.w": layer},
              str(tmp_path / "model.safetensors"))
    assert roofline.decode_weights_bytes(tmp_path) == (800 + 64) * 4   # tied: it is the head
    save_file({"lm_head.weight": torch.zeros(100, 8)}, str(tmp_path / "head.safetensors"))
    assert roofline.decode_weights_bytes(tmp_path) == (800 + 64) * 4   # head, not embedding
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        roofline.decode_weights_bytes(tmp_path / "empty")


def test_bandwidth_is_measured_and_leaves_torch_threads_as_they_were():
    threads = torch.get_num_threads()
    measured = roofline.memory_bandwidth(1, mib=32, repeats=2)
    assert 1e8 < measured < 1e12          # between 0.1 GB/s and 1 TB/s: a real copy ran
    assert torch.get_num_threads() == threads


def test_decode_step_is_set_against_both_floors_and_printed():
    bandwidth = {"one_thread_gb_s": 5.0, "all_cores_gb_s": 10.0, "cores": 2}
    servers = {"spyre_serve": {"phases": {"concurrency_1": {"scheduler": {
                   "server_itl_ms_mean": 80.0}}}},
               "vllm": {"phases": {"concurrency_1": {"scheduler": {
                   "server_itl_ms_mean": 40.0}}}},
               "no_batch_1": {"phases": {"concurrency_4": {"scheduler": {}}}}}
    floor = roofline.decode_vs_floor(servers, 200 * 10**6, bandwidth)
    assert floor["floor_ms"] == {"one_thread": 40.0, "all_cores": 20.0}
    assert floor["servers"]["spyre_serve"]["x_floor"] == {"one_thread": 2.0, "all_cores": 4.0}
    assert floor["servers"]["vllm"]["x_floor"] == {"one_thread": 1.0, "all_cores": 2.0}
    assert floor["servers"]["no_batch_1"] == {"decode_step_ms": None, "x_floor": None}
    lines = report.decode_floor_lines({**floor, "bandwidth": bandwidth})
    assert "floor 40.0 / 20.0 ms" in lines[0]
    assert any(line.split()[:2] == ["spyre_serve", "80.00"] and "2.00x" in line
               for line in lines)
    assert report.decode_floor_lines(None) == []
