"""vLLM engine arguments for Spyre, and starting an engine with them."""
from __future__ import annotations

import contextlib
import os
import uuid
from typing import Any

from spyre_serve.handshake.compiler_report import BLOCK_SIZE
from spyre_serve.vllm_plugin.settings import SpyreSettings

# Engine kwargs spyre_serve sets itself; AppArgs refuses them too (before `serve run` starts).
RESERVED_ENGINE_KWARGS = ("distributed_executor_backend", "additional_config")
# Tested defaults for the CPU validation path; any of them can be overridden.
ENGINE_DEFAULTS: dict[str, Any] = {"dtype": "float32", "enforce_eager": True}


def engine_kwargs(model: str, *, tensor_parallel_size: int = 1, max_model_len: int = 2048,
                  max_num_seqs: int = 8, spyre: SpyreSettings | dict | None = None,
                  card_actors: str = "", **extra: Any) -> dict[str, Any]:
    """Keyword arguments for ``vllm.LLM`` / ``AsyncEngineArgs`` that run on Spyre cards;
    card_actors: the prefix of card actors started ahead (card_actors.CardActorsAhead)."""
    from spyre_serve.vllm_plugin.executor import SpyreRayExecutor
    from spyre_serve.vllm_plugin.platform import check_block_size

    settings = spyre if isinstance(spyre, SpyreSettings) else SpyreSettings.model_validate(spyre or {})
    settings = settings.model_copy(update={"startup_id": uuid.uuid4().hex,
                                           "card_actors": card_actors})
    for reserved in RESERVED_ENGINE_KWARGS:
        if reserved in extra:
            raise ValueError(f"{reserved} is set by spyre_serve; remove it from the engine kwargs")
    check_block_size(extra.get("block_size"))
    return {
        **ENGINE_DEFAULTS,
        **extra,
        "model": model,
        "tensor_parallel_size": tensor_parallel_size,
        "max_model_len": max_model_len,
        "max_num_seqs": max_num_seqs,
        "block_size": BLOCK_SIZE,
        "distributed_executor_backend": SpyreRayExecutor,
        "additional_config": {"spyre": settings.model_dump()},
    }


class SpyreStartupError(RuntimeError):
    """The engine did not start; the message is the cause a rank or the coordinator gave."""


@contextlib.contextmanager
def startup_errors(kwargs: dict[str, Any]):
    settings = SpyreSettings.model_validate(kwargs["additional_config"]["spyre"])
    path = settings.startup_error_file()
    try:
        yield
    except Exception as e:
        if os.path.exists(path):
            with open(path) as f:
                raise SpyreStartupError(f.read()) from e
        raise
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def start_llm(kwargs: dict[str, Any]):
    """A synchronous ``vllm.LLM`` on Spyre cards (tests, benchmarks, scripts)."""
    from vllm import LLM
    with startup_errors(kwargs):
        return LLM(**kwargs, disable_log_stats=False)


def start_async_engine(kwargs: dict[str, Any], **async_llm_kwargs: Any):
    """An ``AsyncLLM`` on Spyre cards (the Serve replica)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM
    with startup_errors(kwargs):
        return AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs), **async_llm_kwargs)

