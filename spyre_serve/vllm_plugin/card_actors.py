"""The card actors: one Ray actor per Spyre card, and starting them ahead of the engine.

A card actor is a fresh Ray worker process that imports vLLM (~7 s on 2 cores) before it
can load weights. vLLM's Ray executor creates its actors only after the EngineCore
subprocess has imported vLLM itself, so the two imports ran one after the other at every
replica start. The Serve replica therefore starts its card actors first, one per `spyre`
bundle of its placement group, before it imports vLLM itself (this module does not): they
import the worker's modules and set up the card's compiler while the replica and then the
EngineCore import vLLM; the executor then adopts them by name where vLLM would create new
ones. Without a replica (`LLM`, scripts) the executor creates them as vLLM does.

vLLM has no way to hand its executor existing actors, so the adoption stands in for the
`ray` module inside vLLM's executor while it creates its workers (guarded in vllm_compat).
"""
from __future__ import annotations

import contextlib
import importlib
import uuid

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from spyre_serve import get_logger, vllm_compat
from spyre_serve.vllm_plugin.settings import RAY_CARD_RESOURCE, SpyreSettings

logger = get_logger(__name__)
NAMESPACE = "spyre_serve"
# Ray's class name of a card actor: started ahead by a replica, or created by vLLM.
CARD_ACTOR_CLASSES = ("CardActor", "SpyreRayWorkerWrapper")


def is_card_actor_process(title: str) -> bool:
    """Whether a process title (Ray titles an actor's process `ray::<class>...`) is a card
    actor's: for tools that find card actors among processes (bench, tests)."""
    return any(f"ray::{name}" in title for name in CARD_ACTOR_CLASSES)


class CardActor:
    """A card actor started ahead: created before its creator has imported vLLM, so its
    class cannot be vLLM's worker wrapper. It holds the rank's wrapper
    (ray_worker.SpyreRayWorkerWrapper) and answers the calls vLLM's executor and ours make
    on a worker actor; tests/test_vllm_compat.py checks these are all of vLLM's calls."""

    def __init__(self, rpc_rank: int):
        self._rpc_rank = rpc_rank
        self._wrapper = None

    def _wrapped(self):
        if self._wrapper is None:
            from spyre_serve.vllm_plugin.ray_worker import SpyreRayWorkerWrapper
            self._wrapper = SpyreRayWorkerWrapper(rpc_rank=self._rpc_rank)
        return self._wrapper

    def preload_worker(self, settings: SpyreSettings) -> None:
        """Import the rank's worker (vLLM's CPU worker and model runner) now, while the
        engine starts elsewhere, instead of in init_worker, and start what the card's
        compiler needs first (card.start_compiler_ahead)."""
        self._wrapped()
        importlib.import_module("spyre_serve.vllm_plugin.worker")
        from spyre_serve.handshake.card import start_compiler_ahead
        start_compiler_ahead(settings)

    # vLLM's executor: placing ranks, and collective_rpc (every worker method goes this way).
    def get_node_ip(self) -> str:
        return self._wrapped().get_node_ip()

    def get_node_and_physical_gpu_ids(self) -> tuple[str, list[int]]:
        return self._wrapped().get_node_and_physical_gpu_ids()

    def execute_method(self, method, *args, **kwargs):
        return self._wrapped().execute_method(method, *args, **kwargs)

    # Ours: an engine step (executor._execute_dag), and the step channel that carries them
    # once the engine serves (step_channel.py).
    def execute_model_ray(self, execute_model_input):
        return self._wrapped().execute_model_ray(execute_model_input)

    def open_step_channel(self, engine_node_id: str) -> str | None:
        return self._wrapped().open_step_channel(engine_node_id)


def card_process_env(settings: SpyreSettings, world_size: int) -> dict[str, str]:
    """The environment a card actor's process starts with: its thread count.

    A card actor reserves its card, not CPUs, and Ray sets OMP_NUM_THREADS=1 in an actor
    that reserves no CPU, so a simulated card ran its model on one thread however many cores
    its node had. It now takes SpyreSettings.threads_per_card: the node's CPUs less one,
    as vLLM's CPU worker does, leaving that one to the serving processes. On this 2-core
    machine that is still one thread: two (cpu_threads_per_card: 2) measured faster decode
    steps but 130-250 ms stalls in streams when the card's second thread lost its core to
    the replica or Serve's proxy (bench/README). The count must be in the environment the
    process starts with: libgomp reads it once, when torch loads it."""
    return {"OMP_NUM_THREADS": str(settings.threads_per_card(world_size))}


def spyre_worker_actors():
    """While vLLM's executor creates its per-rank actors, they are ours."""
    from spyre_serve.vllm_plugin.ray_worker import SpyreRayWorkerWrapper
    return vllm_compat.replaced("vllm.v1.executor.ray_executor:RayWorkerWrapper",
                                lambda _: SpyreRayWorkerWrapper)


def stop(actors) -> None:
    """Kill these actors now, ignoring ones already gone: the replica's failure path and the
    engine's shutdown may both stop the same card actors."""
    for actor in actors:
        with contextlib.suppress(Exception):
            ray.kill(actor)


def _name(prefix: str, rank: int, bundle: int) -> str:
    # A rank's rpc_rank is fixed when its actor is created, so the name holds both.
    return f"{prefix}-rank{rank}-bundle{bundle}"


def _card_bundles(group, world_size: int) -> list[int]:
    """The bundles vLLM's executor puts its ranks in: the first world_size with a card
    (the platform's ray_device_key)."""
    return [i for i, spec in enumerate(group.bundle_specs)
            if spec.get(RAY_CARD_RESOURCE, 0)][:world_size]


def _actor_options(group, bundle: int, env: dict[str, str]) -> dict:
    """What vLLM's executor creates a card actor with (RayDistributedExecutor._init_workers_ray),
    but without the card resource: the placement group already holds the bundle's card for
    this replica, and an actor started ahead that vLLM did not adopt must not keep vLLM's
    own actor from being placed there. The environment is the card's own; what vLLM would
    add to it is checked when the executor adopts the actor (_vllm_env_for_actors)."""
    return {"num_cpus": 0, "num_gpus": 0,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=group, placement_group_capture_child_tasks=True,
                placement_group_bundle_index=bundle),
            "runtime_env": {"env_vars": env}}


def _vllm_env_for_actors() -> dict[str, str]:
    """Environment vLLM would give a card actor beyond ours: its platform's "do not set
    device variables" flags and variables its workers need before import. Both are empty
    for Spyre on CPU builds of vLLM; should a vLLM or platform change fill them, the actors
    started ahead (which lack them) are not adopted."""
    from vllm.platforms import current_platform
    runtime_env: dict = {"env_vars": {var: "1"
                                      for var in current_platform.ray_noset_device_env_vars}}
    vllm_compat.hook("vllm.v1.executor.ray_env_utils:update_runtime_env_for_worker_import")(
        runtime_env)
    return runtime_env["env_vars"]


class CardActorsAhead:
    """Card actors a Serve replica started in its placement group before its engine.

    The replica keeps this object (Ray collects an actor once no handle is left) and passes
    `prefix` to the executor (SpyreSettings.card_actors). The replica owns the actors: they
    end with it, or with the engine's shutdown (the executor kills its workers)."""

    def __init__(self, world_size: int, settings: SpyreSettings):
        group = ray.util.get_current_placement_group()
        bundles = _card_bundles(group, world_size) if group is not None else []
        self.prefix = f"spyre-card-{uuid.uuid4().hex[:12]}" if len(bundles) == world_size else ""
        self.actors = []
        env = card_process_env(settings, world_size)
        for rank, bundle in enumerate(bundles if self.prefix else []):
            actor = ray.remote(**_actor_options(group, bundle, env))(CardActor).options(
                name=_name(self.prefix, rank, bundle), namespace=NAMESPACE).remote(rpc_rank=rank)
            actor.preload_worker.remote(settings)
            self.actors.append(actor)

    def kill(self) -> None:
        """When the engine did not start: stop them now, not when Serve ends the replica."""
        stop(self.actors)


class _AdoptingRay:
    """Stands in for `ray` inside vLLM's executor: `ray.remote(**options)(cls).remote(
    rpc_rank=r)` returns the actor started ahead for that bundle and rank r, if there is
    one; otherwise vLLM creates its own, and `adopting` stops the ones it did not take."""

    def __init__(self, ray_module, prefix: str, started: list[str], adopt: bool = True):
        self._ray, self._prefix, self._started, self.adopted = ray_module, prefix, started, []
        self._adopt = adopt

    def __getattr__(self, name):
        return getattr(self._ray, name)

    def remote(self, *args, **options):
        make = self._ray.remote(*args, **options)
        strategy = options.get("scheduling_strategy")
        bundle = getattr(strategy, "placement_group_bundle_index", None)
        return lambda cls: _Adopter(self, make(cls), bundle)

    def take(self, bundle: int | None, rank: int):
        if not self._adopt:
            return None
        name = _name(self._prefix, rank, bundle)
        try:
            actor = self._ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            return None
        self.adopted.append(name)
        return actor

    def kill_the_rest(self) -> list[str]:
        """Kill the actors started ahead that vLLM did not ask for; return their names."""
        rest = [name for name in self._started if name not in self.adopted]
        for name in rest:
            with contextlib.suppress(ValueError):
                self._ray.kill(self._ray.get_actor(name, namespace=NAMESPACE))
        return rest


class _Adopter:
    def __init__(self, adopting: _AdoptingRay, actor_class, bundle: int | None):
        self._adopting, self._actor_class, self._bundle = adopting, actor_class, bundle

    def remote(self, *, rpc_rank: int):
        actor = self._adopting.take(self._bundle, rpc_rank)
        return actor if actor is not None else self._actor_class.remote(rpc_rank=rpc_rank)


@contextlib.contextmanager
def adopting(prefix: str, group, world_size: int):
    """Within the block, vLLM's executor adopts the card actors started ahead under prefix
    in placement group `group` (the replica named them by its card bundles, as here)."""
    if not prefix:
        yield None
        return
    started = [_name(prefix, rank, bundle)
               for rank, bundle in enumerate(_card_bundles(group, world_size))]
    extra = _vllm_env_for_actors()
    if extra:
        logger.warning("card actors started ahead not adopted: vLLM gives its workers "
                       "environment they lack (%s)", ", ".join(sorted(extra)))
    adopter = _AdoptingRay(ray, prefix, started, adopt=not extra)
    with vllm_compat.replaced("vllm.v1.executor.ray_executor:ray", lambda _: adopter):
        yield adopter
    unused = adopter.kill_the_rest()
    if unused:
        # vLLM created these ranks' actors itself (its executor changed how it creates
        # them): the engine works, the start-ahead only saved nothing.
        logger.warning("card actors started ahead but not adopted (vLLM created its own), "
                       "stopped: %s", ", ".join(unused))
