"""Platform registration, block size, backends and card claims, without an engine."""
import os
import re
import subprocess
import sys
import textwrap
import time
import types

import pytest

from spyre_serve.handshake import card as cards
from support import ROOT
from spyre_serve.vllm_plugin.engine import engine_kwargs
from spyre_serve.vllm_plugin.platform import register
from spyre_serve.vllm_plugin.settings import SpyreSettings


def test_plugin_is_registered_and_can_be_turned_off(monkeypatch):
    from importlib.metadata import entry_points
    (ep,) = [e for e in entry_points(group="vllm.platform_plugins") if e.name == "spyre"]
    assert ep.load() is register
    assert register() == "spyre_serve.vllm_plugin.platform.SpyrePlatform"
    monkeypatch.setenv("SPYRE_SERVE_PLATFORM", "0")
    assert register() is None


def test_vllm_resolves_our_platform():
    out = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        from vllm.platforms import current_platform as p
        print(type(p).__name__, p.ray_device_key, p.device_control_env_var, p.is_cpu())
    """)], capture_output=True, text=True, timeout=120)
    assert out.stdout.split()[-4:] == ["SpyrePlatform", "spyre", "SPYRE_DEVICES", "True"], out.stderr


def test_block_size_other_than_64_is_refused(tiny_model):
    with pytest.raises(ValueError, match="block_size=128 is not supported.*fixed 64-token blocks"):
        engine_kwargs(tiny_model, block_size=128)
    from vllm.engine.arg_utils import EngineArgs
    kwargs = engine_kwargs(tiny_model, max_model_len=256)
    kwargs["block_size"] = 32
    with pytest.raises(ValueError, match="block_size=32 is not supported"):
        EngineArgs(**kwargs).create_engine_config()


def test_block_size_is_forced_to_64(tiny_model):
    from vllm.engine.arg_utils import EngineArgs
    kwargs = engine_kwargs(tiny_model, max_model_len=256)
    del kwargs["block_size"]
    config = EngineArgs(**kwargs).create_engine_config()
    assert config.cache_config.block_size == 64
    assert config.parallel_config.worker_cls == "spyre_serve.vllm_plugin.worker.SpyreWorker"


def test_async_scheduling_is_on_unless_the_user_turns_it_off(tiny_model):
    # vLLM's CPU platform forces it off; ours keeps vLLM's own decision (platform.py).
    from vllm.engine.arg_utils import EngineArgs
    default = EngineArgs(**engine_kwargs(tiny_model, max_model_len=256)).create_engine_config()
    assert default.scheduler_config.async_scheduling is True
    assert default.max_concurrent_batches == 2  # the EngineCore keeps two steps in flight
    off = EngineArgs(**engine_kwargs(tiny_model, max_model_len=256, async_scheduling=False)
                     ).create_engine_config()
    assert off.scheduler_config.async_scheduling is False


def test_sendnn_without_torch_sendnn_refuses_and_says_how_to_fix(tiny_model):
    if "torch_sendnn" in sys.modules:
        pytest.fail("torch_sendnn must not be importable in this test environment")
    with pytest.raises(cards.BackendUnavailable, match="set spyre.backend: cpu"):
        cards.open_card(0, 0, SpyreSettings(backend="sendnn"))
    from vllm.engine.arg_utils import EngineArgs
    with pytest.raises(cards.BackendUnavailable, match="torch_sendnn"):
        EngineArgs(**engine_kwargs(tiny_model, max_model_len=256,
                                   spyre={"backend": "sendnn"})).create_engine_config()


def test_sendnn_report_contract_with_a_fake_torch_sendnn(monkeypatch, tmp_path):
    """Checks OUR side of the contract only: a torch_sendnn stand-in exposing kv_block_report."""
    fake = types.ModuleType("torch_sendnn")
    fake.kv_block_report = lambda device_index: {"num_blocks": 100 + device_index}
    monkeypatch.setitem(sys.modules, "torch_sendnn", fake)
    card = cards.open_card(3, 1, SpyreSettings(backend="sendnn", report_dir=str(tmp_path)))
    assert isinstance(card, cards.SendnnCard) and card.device == "spyre3"
    started = time.time() - 1
    card.publish_block_report("m", 256, cards.WarmupMeasurement(10, 0, 4096))
    report = card.read_block_report("m", 256, not_before=started)
    assert (report.num_blocks, report.source, report.rank) == (103, "compiler", 1)


def test_budgets_per_rank():
    s = SpyreSettings(card_memory_bytes=[10, 20])
    assert (s.budget_for_rank(0), s.budget_for_rank(1)) == (10, 20)
    with pytest.raises(ValueError, match="one budget per tensor-parallel rank"):
        s.budget_for_rank(2)
    with pytest.raises(ValueError, match="positive"):
        SpyreSettings(card_memory_bytes=[10, 0])


def test_a_node_label_sets_the_budget_of_its_cards():
    from spyre_serve.vllm_plugin.settings import CARD_MEMORY_LABEL
    s = SpyreSettings(card_memory_bytes=[10, 20])
    assert s.card_budget(1, {}) == 20
    assert s.card_budget(1, {CARD_MEMORY_LABEL: "300", "other": "x"}) == 300
    for bad in ("0", "-5", "2GiB"):
        with pytest.raises(ValueError, match=CARD_MEMORY_LABEL):
            s.card_budget(0, {CARD_MEMORY_LABEL: bad})
    # README's `ray start --labels=...` for it is what Ray's own parser accepts.
    from ray._private.label_utils import parse_node_labels_string
    flag = re.search(r"`--labels=([^`]+)`", (ROOT / "README.md").read_text()).group(1)
    labels = parse_node_labels_string(flag)
    assert s.card_budget(0, labels) == 512 * 2**20


CLAIM = """
import sys
from spyre_serve.handshake.card import claim_card
try:
    print(claim_card(sys.argv[1], 2), flush=True)
except RuntimeError as e:
    print(e, flush=True)
sys.stdin.read()  # hold the claim until the test closes our stdin
"""


def _claimer(node):
    p = subprocess.Popen([sys.executable, "-c", CLAIM, node], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    return p, p.stdout.readline().strip()


def test_each_card_is_claimed_by_one_process_and_freed_when_it_dies():
    node = f"test-node-{time.time_ns()}"
    claims = [_claimer(node) for _ in range(3)]
    try:
        got = [line for _, line in claims]
        assert sorted(got[:2]) == ["0", "1"]
        assert "All 2 Spyre cards" in got[2]
        holder_of_0 = claims[got.index("0")][0]
        holder_of_0.kill()
        holder_of_0.wait(30)
        claims.append(_claimer(node))
        assert claims[-1][1] == "0"
    finally:
        for p, _ in claims:
            p.kill()
            p.wait(30)


def test_card_threads_are_the_nodes_cpus_less_one_shared_among_ranks_unless_set():
    from pydantic import ValidationError

    from spyre_serve.vllm_plugin.card_actors import card_process_env
    from spyre_serve.vllm_plugin.settings import SpyreSettings

    cpus = len(os.sched_getaffinity(0))
    assert card_process_env(SpyreSettings(), 1) == {"OMP_NUM_THREADS": str(max(1, cpus - 1))}
    assert SpyreSettings().threads_per_card(cpus * 2) == 1  # never fewer than one
    assert card_process_env(SpyreSettings(cpu_threads_per_card=3), 2) == {"OMP_NUM_THREADS": "3"}
    with pytest.raises(ValidationError, match="cpu_threads_per_card"):
        SpyreSettings(cpu_threads_per_card=-1)
