"""Spyre cards: which card a rank owns, and the compiler that runs programs on it.

A card is claimed with an exclusive file lock held for the life of the worker process,
so two replicas on one node never share a card and a crashed worker frees its card.
"""
from __future__ import annotations

import fcntl
import functools
import importlib
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from spyre_serve import get_logger
from spyre_serve.handshake.compiler_report import (
    BlockReport,
    read_report,
    report_path,
    write_report,
)
from spyre_serve.vllm_plugin.settings import SpyreSettings, node_scratch

logger = get_logger(__name__)

_CLAIM_DIR = Path(node_scratch("cards"))
_claimed: tuple[int, int] | None = None  # (card index, lock fd) of this process


class BackendUnavailable(RuntimeError):
    pass


def require_backend(backend: str):
    """Return the torch_sendnn module for ``sendnn``; refuse loudly when it is not importable."""
    if backend != "sendnn":
        return None
    try:
        return importlib.import_module("torch_sendnn")
    except ImportError as e:
        raise BackendUnavailable(
            f"backend 'sendnn' needs IBM's torch_sendnn, which does not import here ({e}). "
            "Install the Spyre software stack on this node, or set spyre.backend: cpu to run on "
            "simulated cards.") from None


def claimed_card_index() -> int | None:
    return None if _claimed is None else _claimed[0]


def claim_card(node_id: str, num_cards: int) -> int:
    """Claim the lowest free card on this node for this process (idempotent)."""
    global _claimed
    if _claimed is not None:
        return _claimed[0]
    lock_dir = _CLAIM_DIR / node_id
    lock_dir.mkdir(parents=True, exist_ok=True)
    for index in range(num_cards):
        fd = os.open(lock_dir / f"card{index}.lock", os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        _claimed = (index, fd)
        return index
    raise RuntimeError(
        f"All {num_cards} Spyre cards of node {node_id} are claimed by other workers "
        f"(locks in {lock_dir}); Ray granted a 'spyre' resource with no free card behind it. "
        "Check that the node's 'spyre' resource count matches its cards.")


@dataclass
class WarmupMeasurement:
    weights_bytes: int
    activation_peak_bytes: int
    bytes_per_block: int


class Card:
    """One card, as its worker sees it: an id, a compiler, and the block report it writes."""

    source = "compiler"
    identity: int | str  # what the warm-start key records of this card

    def __init__(self, index: int, rank: int, settings: SpyreSettings):
        self.index = index
        self.rank = rank
        self.settings = settings
        self.device = f"spyre{index}"

    @property
    def report_file(self) -> Path:
        return report_path(self.settings.reports, self.device)

    def compiler(self) -> Callable[[Callable, tuple], Callable]:
        """The card's compiler: (fn, example arguments) -> `fn` compiled for this card,
        the first dimension of its tensor arguments dynamic."""
        raise NotImplementedError

    def compiler_ready(self) -> None:
        """Return once the compiler's own setup is done (before the first compile)."""

    def publish_block_report(self, model: str, max_model_len: int,
                             measured: WarmupMeasurement) -> None:
        raise NotImplementedError

    def read_block_report(self, model: str, max_model_len: int, not_before: float) -> BlockReport:
        return read_report(self.report_file, device=self.device, rank=self.rank, model=model,
                           max_model_len=max_model_len, not_before=not_before)


def _picked_vector_isa_builds() -> bool:
    """Build and load inductor's vector-code test for the one ISA it will pick, as
    inductor does; False when not inductor's x86 case."""
    import platform

    from spyre_serve.vllm_compat import hook
    if platform.machine() not in ("x86_64", "AMD64"):
        return False
    module = "torch._inductor.cpu_vec_isa:"
    listed = hook(module + "x86_isa_checker")()
    usable = [isa for isa in hook(module + "supported_vec_isa_list")
              if all(flag in listed for flag in str(isa).split())]
    if not usable:
        return False
    chosen = hook(module + "get_isa_from_cpu_capability")(
        os.getenv("ATEN_CPU_CAPABILITY"), usable, hook(module + "invalid_vec_isa"))
    return chosen in usable and chosen.check_build(hook(module + "VecISA._avx_code"))


class CompilerSetup:
    """The simulated card's compiler setup, once per process, in a thread.

    1. Before its first CPU compile, inductor builds and loads a test library for every
       vector ISA the CPU lists (here AMX, AVX512-VNNI, AVX512, AVX2: ~7 s of g++ on 2
       cores, at each cold start on a node), then uses one. This tests that one alone;
       `apply()` then tells inductor the listed ISAs are usable (`cpp.vec_isa_ok`), so it
       picks the same one untested. If the test fails, inductor tests them all, as before.
       Torch has no switch for "test only the one you pick", hence this.
    2. With `warm_compile`, it then compiles a throwaway program
       (attention.warm_up_compiler): a card actor the replica starts ahead (card_actors)
       does this while the EngineCore imports vLLM, and warmup's compile finds inductor's
       setup done.

    It runs beside the weights loading or the engine's start (mostly g++ in a subprocess)."""

    _started: CompilerSetup | None = None
    INDUCTOR_CONFIG = {
        # No precompiled header: building it (149 MiB of ATen's vector headers) costs
        # ~4.4 s the first time on a node, more than our small programs ever save with it,
        # and a replica autoscaled onto a fresh node always pays it. Our compiles only.
        "cpp_cache_precompile_headers": False}

    @classmethod
    def start(cls, warm_compile: bool = False) -> CompilerSetup:
        """This process's setup, started by the first caller (a later one joins it)."""
        if cls._started is None:
            cls._started = cls(warm_compile)
        return cls._started

    def __init__(self, warm_compile: bool):
        self.passed = False
        self._warm_compile = warm_compile
        self._thread = threading.Thread(target=self._run, name="inductor-compiler-setup",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self.passed = _picked_vector_isa_builds()
        if not self._warm_compile:
            return
        from spyre_serve.vllm_plugin.attention import warm_up_compiler
        try:
            self._apply_isa()
            warm_up_compiler(self.INDUCTOR_CONFIG)
        except Exception as e:  # noqa: BLE001 - only time is lost; warmup's compile reports
            logger.warning("the compiler's warm-up compile failed (%s: %s); warmup "
                           "compiles cold", type(e).__name__, e)

    def _apply_isa(self) -> None:
        # Torch keeps inductor settings per thread, so only in the thread that compiles is
        # a value the user set (TORCHINDUCTOR_VEC_ISA_OK or code) seen and kept.
        from spyre_serve.vllm_compat import hook
        if self.passed and hook("torch._inductor.config:cpp.vec_isa_ok") is None:
            from torch._inductor import config
            config.cpp.vec_isa_ok = True

    def apply(self) -> None:
        """Call from the thread that compiles, before it compiles."""
        self._thread.join()
        self._apply_isa()


class SimulatedCard(Card):
    """A card with a memory budget, served by vLLM's CPU kernels and inductor.

    The budget is the node's `spyre-serve/card-memory-bytes` label when it has one (unlike
    cards on unlike nodes), else spyre.card_memory_bytes."""

    source = "simulated"

    def __init__(self, index: int, rank: int, settings: SpyreSettings):
        super().__init__(index, rank, settings)
        self.device = f"sim{index}"
        self.memory_budget_bytes = settings.card_budget(rank, _node_labels())
        self._setup: CompilerSetup | None = None   # started by compiler() or earlier

    @property
    def identity(self) -> int:
        return self.memory_budget_bytes

    def compiler(self) -> Callable[[Callable, tuple], Callable]:
        from spyre_serve.vllm_plugin.attention import compile_ahead
        self._setup = CompilerSetup.start()  # runs while the model loads, if not already
        return functools.partial(compile_ahead, inductor_config=CompilerSetup.INDUCTOR_CONFIG)

    def compiler_ready(self) -> None:
        # Before the worker points TORCHINDUCTOR_CACHE_DIR at the key's cache, and in the
        # thread that then compiles (the warmup's).
        if self._setup is not None:
            self._setup.apply()

    def publish_block_report(self, model: str, max_model_len: int,
                             measured: WarmupMeasurement) -> None:
        """The simulated compiler: what is left of the budget, in whole blocks."""
        free = self.memory_budget_bytes - measured.weights_bytes - measured.activation_peak_bytes
        num_blocks = max(0, free // measured.bytes_per_block)
        report = BlockReport(
            device=self.device, rank=self.rank, num_blocks=int(num_blocks), model=model,
            max_model_len=max_model_len, source=self.source, created_at=time.time(),
            memory_budget_bytes=self.memory_budget_bytes, weights_bytes=measured.weights_bytes,
            activation_peak_bytes=measured.activation_peak_bytes,
            bytes_per_block=measured.bytes_per_block)
        write_report(self.report_file, report)


class SendnnCard(Card):
    """A real card: torch_sendnn compiles, and its compiler reports the blocks it can hold."""

    identity = "spyre"  # what it holds is its compiler's to say, after warmup

    def __init__(self, index: int, rank: int, settings: SpyreSettings, torch_sendnn):
        super().__init__(index, rank, settings)
        self.torch_sendnn = torch_sendnn

    def compiler(self) -> Callable[[Callable, tuple], Callable]:
        from spyre_serve.vllm_plugin.attention import compile_with_dynamo
        return compile_with_dynamo("sendnn")

    def publish_block_report(self, model: str, max_model_len: int,
                             measured: WarmupMeasurement) -> None:
        # A compiler that exposes its report as a function gets it written in our format;
        # one that writes the file itself (to report_file) needs nothing from us.
        get_report = getattr(self.torch_sendnn, "kv_block_report", None)
        if get_report is None:
            return
        data = get_report(self.index)
        report = BlockReport(
            device=self.device, rank=self.rank, num_blocks=int(data["num_blocks"]), model=model,
            max_model_len=max_model_len, source=self.source, created_at=time.time(),
            bytes_per_block=measured.bytes_per_block, weights_bytes=measured.weights_bytes)
        write_report(self.report_file, report)


def _node_labels() -> dict[str, str]:
    import ray
    return ray.get_runtime_context().get_node_labels() if ray.is_initialized() else {}


def start_compiler_ahead(settings: SpyreSettings) -> None:
    """Begin the card's compiler setup before the card is opened (a card actor started
    ahead of its engine), so it runs beside the engine's start. Only a simulated card that
    compiles its KV program has such a setup; a real card's compiler is torch_sendnn's."""
    if settings.backend == "cpu" and settings.compile_kv_program:
        CompilerSetup.start(warm_compile=True)


def open_card(index: int, rank: int, settings: SpyreSettings) -> Card:
    torch_sendnn = require_backend(settings.backend)
    if torch_sendnn is not None:
        return SendnnCard(index, rank, settings, torch_sendnn)
    return SimulatedCard(index, rank, settings)

