"""Arguments of the Serve application, and what they turn into: engine kwargs and Serve options.

Pure logic, no Ray and no engine, so `serve run` can reject a bad config before anything
starts and the rules can be unit tested.
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, field_validator, model_validator

from spyre_serve.vllm_plugin.engine import RESERVED_ENGINE_KWARGS
from spyre_serve.vllm_plugin.settings import RAY_CARD_RESOURCE, SpyreSettings
from spyre_serve.ops.models import BUILTIN_MODELS, BUILTIN_PREFIX, DEMO_MODEL


# Engine kwargs the app sets from its own fields: a second way to set them would be ambiguous.
_OWN_FIELDS = {"model": "model", "served_model_name": "served_model_name",
               "tensor_parallel_size": "tensor_parallel_size",
               "max_model_len": "max_model_len", "max_num_seqs": "max_num_seqs"}


class AppArgs(BaseModel):
    """`args:` of serve_config.yaml. Unknown fields are errors, so a typo never goes unnoticed."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(DEMO_MODEL, description="Local HF model folder, or one of "
                       + ", ".join(BUILTIN_PREFIX + name for name in BUILTIN_MODELS)
                       + " (built once on each node, cached)")
    served_model_name: str | None = Field(
        None, description="Name clients put in `model`; default: the model without builtin:")
    tensor_parallel_size: PositiveInt = Field(1, description="Spyre cards per replica")
    max_model_len: PositiveInt = 2048
    max_num_seqs: PositiveInt = 8
    spyre: SpyreSettings = Field(
        default_factory=SpyreSettings, description="The cards: backend (cpu: simulated, "
        "sendnn: real), card_memory_bytes (simulated budgets), ... (SpyreSettings, the same "
        "object every rank reads from vLLM's config)")
    engine_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Passed to vLLM's AsyncEngineArgs as they are")
    frontend_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="`vllm serve`'s frontend options (vLLM's FrontendArgs): "
        "chat_template, enable_auto_tool_choice, tool_call_parser, response_role, api_key, ...")
    api_key_file: str | None = Field(
        None, description="A file on every node holding the API key, so it stays out of the "
        "YAML (e.g. a mounted secret); same effect as frontend_kwargs.api_key")

    num_replicas: PositiveInt | None = Field(None, description="Fixed replica count")
    autoscaling_config: dict[str, Any] | None = Field(
        None, description="Ray Serve autoscaling_config, passed through (instead of num_replicas)")
    request_router_config: dict[str, Any] | None = Field(
        None, description="Ray Serve request_router_config, passed through; e.g. "
        "request_router_class: spyre_serve.serve.kv_routing:KVCapacityRouter")
    max_ongoing_requests: PositiveInt = Field(
        64, description="Per replica; vLLM queues what its max_num_seqs cannot run at once")
    replica_num_cpus: float = Field(
        1.0, gt=0, description="CPUs of bundle 0, where the replica (HTTP + engine frontend) runs")
    # Warmup compiles and runs the model before the replica exists for Serve, so these only
    # need to cover a busy engine, not startup; startup has its own limit.
    health_check_period_s: float = Field(10.0, gt=0)
    health_check_timeout_s: float = Field(30.0, gt=0)
    graceful_shutdown_timeout_s: float = Field(20.0, ge=0)
    engine_start_timeout_s: float = Field(
        3600.0, gt=0, description="Model load + warmup + block handshake, per replica")
    stream_batching_interval_ms: float = Field(
        0.0, ge=0, description="Coalesce streamed chunks for this long; 0 sends each token as it comes")

    @field_validator("engine_kwargs")
    @classmethod
    def _engine_kwargs_are_vllm_args(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        for key in kwargs:
            if key in _OWN_FIELDS:
                raise ValueError(f"engine_kwargs.{key}: set it with the app argument "
                                 f"`{_OWN_FIELDS[key]}` instead")
            if key in RESERVED_ENGINE_KWARGS:
                raise ValueError(f"engine_kwargs.{key} is set by spyre_serve; remove it")
        if kwargs:
            _refuse_unknown("engine_kwargs", kwargs, _vllm_engine_arg_names(),
                            "an argument of vLLM's AsyncEngineArgs")
        if "block_size" in kwargs:
            from spyre_serve.vllm_plugin.platform import check_block_size
            check_block_size(kwargs["block_size"])
        return kwargs

    @field_validator("frontend_kwargs")
    @classmethod
    def _frontend_kwargs_are_vllm_args(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        for key in kwargs:
            if key in _NOT_UNDER_SERVE:
                raise ValueError(f"frontend_kwargs.{key} belongs to the HTTP server, which is "
                                 "Ray Serve's here: set http_options in serve_config.yaml")
        if not kwargs:  # nothing to check: vLLM's import stays out of `serve run`'s build
            return kwargs
        _refuse_unknown("frontend_kwargs", kwargs, _vllm_frontend_arg_names(),
                        "one of vLLM's frontend options")
        if isinstance(kwargs.get("api_key"), str):
            kwargs = {**kwargs, "api_key": [kwargs["api_key"]]}
        from vllm.entrypoints.launchers.cli_args import FrontendArgs
        FrontendArgs(**kwargs)  # vLLM's own types and checks
        parser = kwargs.get("tool_call_parser")
        if parser:
            from vllm.tool_parsers import ToolParserManager
            known = ToolParserManager.list_registered()
            if parser not in known and not kwargs.get("tool_parser_plugin"):
                raise ValueError(f"frontend_kwargs.tool_call_parser {parser!r} is not one of "
                                 f"vLLM's tool-call parsers ({', '.join(sorted(known))})")
        return kwargs

    @field_validator("spyre")
    @classmethod
    def _no_internal_settings(cls, settings: SpyreSettings) -> SpyreSettings:
        if settings.startup_id:
            raise ValueError("spyre.startup_id is set by spyre_serve on each engine start; "
                             "remove it")
        return settings

    @model_validator(mode="after")
    def _one_way_to_scale(self) -> "AppArgs":
        if self.api_key_file is not None and self.frontend_kwargs.get("api_key"):
            raise ValueError("api_key_file and frontend_kwargs.api_key exclude each other")
        if self.num_replicas is not None and self.autoscaling_config is not None:
            raise ValueError("num_replicas and autoscaling_config exclude each other: "
                             "give one of them")
        budgets = self.spyre.card_memory_bytes
        if isinstance(budgets, list) and len(budgets) != self.tensor_parallel_size:
            raise ValueError(f"spyre.card_memory_bytes lists {len(budgets)} budgets "
                             f"for tensor_parallel_size={self.tensor_parallel_size}: give one "
                             "per rank, or a single number")
        return self

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        return self.model.removeprefix(BUILTIN_PREFIX)

    def engine_kwargs_for(self, model_path: str) -> dict[str, Any]:
        """Arguments for spyre_serve.vllm_plugin.engine.engine_kwargs, once the model is on this node."""
        return {
            "model": model_path,
            "tensor_parallel_size": self.tensor_parallel_size,
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.max_num_seqs,
            "spyre": self.spyre,
            "served_model_name": [self.model_name],
            # The status and metrics endpoints read vLLM's scheduler stats.
            "disable_log_stats": False,
            **self.engine_kwargs,
        }

    def frontend_options(self) -> dict[str, Any]:
        """frontend_kwargs, with the API key read from api_key_file (on the replica's node)."""
        options = dict(self.frontend_kwargs)
        if self.api_key_file is not None:
            from pathlib import Path
            key = Path(self.api_key_file).read_text().strip()
            if not key:
                raise ValueError(f"api_key_file {self.api_key_file} is empty")
            options["api_key"] = [key]
        return options

    def placement_group_bundles(self) -> list[dict[str, float]]:
        """Bundle 0 holds the replica actor; one card per tensor-parallel rank after it."""
        return [{"CPU": self.replica_num_cpus}] + [{RAY_CARD_RESOURCE: 1}] * self.tensor_parallel_size

    def deployment_options(self) -> dict[str, Any]:
        """Keyword arguments for `Deployment.options`."""
        options: dict[str, Any] = {
            "ray_actor_options": {"num_cpus": self.replica_num_cpus},
            # STRICT_PACK: a TP group's cards talk over the node's links, never across nodes.
            "placement_group_bundles": self.placement_group_bundles(),
            "placement_group_strategy": "STRICT_PACK",
            "max_ongoing_requests": self.max_ongoing_requests,
            "health_check_period_s": self.health_check_period_s,
            "health_check_timeout_s": self.health_check_timeout_s,
            "graceful_shutdown_timeout_s": self.graceful_shutdown_timeout_s,
        }
        if self.request_router_config is not None:
            options["request_router_config"] = self.request_router_config
        if self.autoscaling_config is not None:
            options["autoscaling_config"] = self.autoscaling_config
        else:
            options["num_replicas"] = self.num_replicas or 1
        return options


# FrontendArgs that configure uvicorn or the socket: under Ray Serve its proxy does that.
_NOT_UNDER_SERVE = {
    "host", "port", "uds", "root_path", "uvicorn_log_level", "disable_uvicorn_access_log",
    "ssl_keyfile", "ssl_certfile", "ssl_ca_certs", "enable_ssl_refresh", "ssl_cert_reqs",
    "ssl_ciphers", "h11_max_incomplete_event_size", "h11_max_header_count", "grpc_port",
    "data_parallel_supervisor_port", "dp_supervisor_probe_interval_s",
    "dp_supervisor_probe_timeout_s", "dp_supervisor_probe_failure_threshold"}


def _refuse_unknown(field: str, kwargs: dict[str, Any], names: set[str], what: str) -> None:
    unknown = sorted(set(kwargs) - names)
    if unknown:
        raise ValueError(f"{field}.{unknown[0]} is not {what} (unknown: {', '.join(unknown)})")


def _vllm_frontend_arg_names() -> set[str]:
    import dataclasses

    from vllm.entrypoints.launchers.cli_args import FrontendArgs
    return {f.name for f in dataclasses.fields(FrontendArgs)}


def _vllm_engine_arg_names() -> set[str]:
    # From vLLM's source, not its import: this runs in Serve's app-build task (vllm_compat).
    from spyre_serve.vllm_compat import dataclass_field_names
    return dataclass_field_names("vllm.engine.arg_utils", "AsyncEngineArgs")
