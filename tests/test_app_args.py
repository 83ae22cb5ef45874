"""The Serve app's arguments and the options they become; no engine, no Ray cluster."""
import asyncio

import pytest
import yaml
from pydantic import ValidationError
from ray.serve._private.api import call_user_app_builder_with_args_if_necessary

from deployments.openai_app import build_app
from spyre_serve.serve.app_args import AppArgs
from spyre_serve.ops.cli import config_uses_demo_model, discover_cards, start_command
from spyre_serve.serve.openai_api import coalesce


def test_unknown_field_is_named_by_serves_own_builder_path():
    # The function `serve run` calls to turn `args:` into the builder's pydantic model.
    with pytest.raises(ValidationError) as err:
        call_user_app_builder_with_args_if_necessary(build_app, {"max_num_seq": 4})
    assert "max_num_seq" in str(err.value)
    assert "Extra inputs are not permitted" in str(err.value)


@pytest.mark.parametrize("args, named", [
    ({"spyre": {"backend": "gpu"}}, "spyre.backend"),
    ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
    ({"spyre": {"card_memory_bytes": -1}}, "card_memory_bytes"),
    ({"backend": "cpu"}, "backend"),  # a field of `spyre:` now, not of the app
    ({"spyre": {"startup_id": "x"}}, "spyre.startup_id is set by spyre_serve"),
    ({"engine_kwargs": {"not_a_vllm_arg": 1}}, "not_a_vllm_arg"),
    ({"engine_kwargs": {"max_model_len": 64}}, "max_model_len"),
    ({"engine_kwargs": {"distributed_executor_backend": "mp"}}, "distributed_executor_backend"),
    ({"num_replicas": 2, "autoscaling_config": {"max_replicas": 2}}, "autoscaling_config"),
    ({"tensor_parallel_size": 2, "spyre": {"card_memory_bytes": [1, 2, 3]}},
     "spyre.card_memory_bytes lists 3 budgets"),
    ({"frontend_kwargs": {"tool_parser_nmae": "hermes"}}, "frontend_kwargs.tool_parser_nmae"),
    ({"frontend_kwargs": {"port": 9000}}, "http_options"),
    ({"frontend_kwargs": {"enable_auto_tool_choice": True, "tool_call_parser": "nope"}},
     "tool_call_parser 'nope'"),
    ({"frontend_kwargs": {"api_key": "a"}, "api_key_file": "/k"}, "api_key_file"),
    ({"engine_kwargs": {"block_size": 16}}, "block_size=16 is not supported"),
])
def test_invalid_args_name_the_field(args, named):
    with pytest.raises(ValidationError) as err:
        AppArgs.model_validate(args)
    assert named in str(err.value)


def test_unknown_frontend_option_fails_serves_builder_naming_it():
    with pytest.raises(Exception) as err:
        call_user_app_builder_with_args_if_necessary(
            build_app, {"frontend_kwargs": {"chat_templat": "x"}})
    assert "frontend_kwargs.chat_templat" in str(err.value)


def test_frontend_options_reach_vllms_own_namespace(tmp_path):
    from spyre_serve.vllm_plugin.engine import engine_kwargs
    from spyre_serve.serve.openai_api import api_keys, serve_namespace
    key = tmp_path / "key"
    key.write_text("sk-123\n")
    args = AppArgs(api_key_file=str(key), frontend_kwargs={
        "enable_auto_tool_choice": True, "tool_call_parser": "pythonic",
        "response_role": "helper"})
    namespace = serve_namespace(engine_kwargs(str(tmp_path), max_model_len=256),
                                args.frontend_options())
    assert (namespace.tool_call_parser, namespace.response_role) == ("pythonic", "helper")
    assert api_keys(namespace) == ["sk-123"]


def test_replica_reserves_its_actor_bundle_and_one_card_per_rank():
    options = AppArgs(tensor_parallel_size=4, replica_num_cpus=0.5).deployment_options()
    assert options["placement_group_bundles"] == [{"CPU": 0.5}] + [{"spyre": 1}] * 4
    assert options["placement_group_strategy"] == "STRICT_PACK"
    # The replica actor lives in bundle 0, so it may ask for no more than that bundle holds.
    assert options["ray_actor_options"] == {"num_cpus": 0.5}
    assert options["num_replicas"] == 1


def test_autoscaling_config_is_passed_through_instead_of_num_replicas():
    scaling = {"min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 2}
    options = AppArgs(autoscaling_config=scaling).deployment_options()
    assert options["autoscaling_config"] == scaling
    assert "num_replicas" not in options


def test_builder_applies_the_options_to_the_deployment():
    app = call_user_app_builder_with_args_if_necessary(
        build_app, {"tensor_parallel_size": 2, "max_ongoing_requests": 7,
                    "health_check_timeout_s": 99})
    deployment = app._bound_deployment
    assert deployment._deployment_config.max_ongoing_requests == 7
    assert deployment._deployment_config.health_check_timeout_s == 99
    assert deployment._replica_config.placement_group_bundles == \
        [{"CPU": 1.0}, {"spyre": 1}, {"spyre": 1}]


def test_engine_kwargs_carry_model_names_budgets_and_pass_through():
    args = AppArgs(model="builtin:tiny-llama", spyre={"card_memory_bytes": [2**30, 2**29]},
                   tensor_parallel_size=2, engine_kwargs={"seed": 7})
    kwargs = args.engine_kwargs_for("/models/tiny")
    assert kwargs["model"] == "/models/tiny"
    assert kwargs["served_model_name"] == ["tiny-llama"]
    assert (kwargs["spyre"].backend, kwargs["spyre"].card_memory_bytes) == \
        ("cpu", [2**30, 2**29])
    assert kwargs["seed"] == 7
    assert AppArgs(served_model_name="x").model_name == "x"


def test_repo_serve_config_is_valid_and_uses_the_demo_model():
    config = yaml.safe_load(open("serve_config.yaml"))
    (app,) = config["applications"]
    assert app["import_path"] == "deployments.openai_app:build_app"
    args = AppArgs.model_validate(app["args"])
    assert args.model == "builtin:smollm2-135m-instruct" and args.spyre.backend == "cpu"
    assert config_uses_demo_model(__import__("pathlib").Path("serve_config.yaml"))


def test_card_discovery_counts_spyre_pci_functions_only(tmp_path):
    for name, vendor, device in [("0000:01:00.0", "0x1014", "0x06a7"),
                                 ("0000:02:00.0", "0x1014", "0x06a7"),
                                 ("0000:03:00.0", "0x8086", "0x06a7")]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "vendor").write_text(vendor + "\n")
        (tmp_path / name / "device").write_text(device + "\n")
    assert discover_cards(tmp_path) == 2
    assert discover_cards(tmp_path / "absent") == 0
    assert '--resources={"spyre": 3}' in start_command(3, None, 6379)


async def _chunks(delays):
    for i, delay in enumerate(delays):
        await asyncio.sleep(delay)
        yield f"data: {i}\n\n"


def test_stream_interval_zero_forwards_each_chunk():
    async def collect():
        return [c async for c in coalesce(_chunks([0, 0, 0]), 0)]
    assert asyncio.run(collect()) == ["data: 0\n\n", "data: 1\n\n", "data: 2\n\n"]


def test_stream_interval_coalesces_close_chunks_but_not_late_ones():
    async def collect():
        return [c async for c in coalesce(_chunks([0, 0, 0.3]), 0.1)]
    assert asyncio.run(collect()) == ["data: 0\n\ndata: 1\n\n", "data: 2\n\n"]


@pytest.mark.parametrize("interval_s", [0, 0.05])
def test_closing_a_stream_closes_the_engine_stream_at_once(interval_s):
    """A client hang-up closes our stream; the engine's generator must close with it (that
    is what aborts the request), not whenever the garbage collector gets to it."""
    closed = asyncio.Event()

    async def engine_stream():
        try:
            for i in range(1000):
                await asyncio.sleep(0.001)
                yield f"data: {i}\n\n"
        finally:
            closed.set()

    async def read_one_then_close():
        stream = coalesce(engine_stream(), interval_s)
        first = await anext(stream)
        await stream.aclose()
        return first, closed.is_set()

    first, was_closed = asyncio.run(read_one_then_close())
    assert first.startswith("data: 0")
    assert was_closed


def test_example_cluster_configs_declare_spyre_and_valid_app_args():
    service = yaml.safe_load(open("examples/kuberay-rayservice.yaml"))
    (app,) = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"]
    AppArgs.model_validate(app["args"])
    (group,) = service["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert '\\"spyre\\": 8' in group["rayStartParams"]["resources"]
    cluster = yaml.safe_load(open("examples/ray-cluster.yaml"))
    assert cluster["available_node_types"]["spyre_8x"]["resources"]["spyre"] == 8
    # Their nodes run Serve as the nodes spyre-serve starts do (the image sets it for KubeRay).
    from spyre_serve.ops.cli import SERVE_NODE_ENV
    starts = [c for key in ("head_start_ray_commands", "worker_start_ray_commands")
              for c in cluster[key] if "ray start" in c]
    containerfile = open("Containerfile").read()
    for name, value in SERVE_NODE_ENV.items():
        assert all(f"{name}={value} " in c for c in starts), starts
        assert f"ENV {name}={value}" in containerfile


def test_container_image_installs_through_the_ci_install_script():
    """No container engine runs here (docker's daemon is absent, see README): check what
    can be checked, that the image and CI share one install path and the examples name it."""
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    runs = [line for line in (root / "Containerfile").read_text().splitlines()
            if line.startswith("RUN ")]
    assert any("bash scripts/install.sh" in line for line in runs)
    assert "scripts/install.sh" in (root / "Makefile").read_text()
    for example in ("kuberay-rayservice.yaml",):
        text = (root / "examples" / example).read_text()
        assert "image: spyre-serve:0.1.0" in text and "registry.example.com" not in text


def test_serves_app_build_validates_engine_kwargs_without_importing_vllm():
    # Serve builds the app in a fresh process before it adds a replica: an import of vLLM
    # there (~6 s) was on every start's path. A typo is still refused there (above).
    assert_imports_neither_vllm_nor_torch(
        "from ray.serve._private.api import call_user_app_builder_with_args_if_necessary\n"
        "from deployments.openai_app import build_app\n"
        "call_user_app_builder_with_args_if_necessary(build_app, {'engine_kwargs': "
        "{'num_gpu_blocks_override': 64}, 'frontend_kwargs': {}})\n")


def assert_imports_neither_vllm_nor_torch(code: str) -> None:
    """Run `code` in a fresh interpreter; neither vLLM nor torch may be imported after it."""
    import subprocess
    import sys
    from pathlib import Path
    code += "import sys\nprint(sorted(m for m in ('vllm', 'torch') if m in sys.modules))\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=str(Path(__file__).parents[1]))
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stderr[-2000:]


def test_nodes_spyre_serve_starts_run_serves_proxy_over_grpc_unless_told_otherwise():
    from spyre_serve.ops.cli import node_env
    assert node_env({"PATH": "/bin"})["RAY_SERVE_PROXY_USE_GRPC"] == "1"
    assert node_env({"RAY_SERVE_PROXY_USE_GRPC": "0"})["RAY_SERVE_PROXY_USE_GRPC"] == "0"
    assert node_env({"PATH": "/bin"})["PATH"] == "/bin"


def test_a_replica_starts_its_card_actors_before_it_imports_vllm():
    # The card actors import vLLM while the replica does, instead of after (card_actors.py):
    # only if the replica and what it calls first import neither vLLM nor torch.
    assert_imports_neither_vllm_nor_torch(
        "import spyre_serve.serve.replica, spyre_serve.vllm_plugin.card_actors\n"
        "import spyre_serve.handshake.catalog\n")


def test_a_temp_dir_too_long_for_rays_sockets_is_refused_before_ray_starts(tmp_path):
    # Ray checks only its object store's socket: a temp dir a few characters too long
    # started, lost its dashboard a minute later, then the head, and `serve run` waited
    # for the gone GCS forever. spyre-serve refuses it at once, naming the fix.
    import os
    import subprocess

    from spyre_serve.ops.cli import temp_dir_problem, tool
    assert temp_dir_problem("/tmp/ray") is None
    long_dir = tmp_path / ("x" * 40) / "ray"
    assert "too long" in temp_dir_problem(str(long_dir))
    config = tmp_path / "serve_config.yaml"
    config.write_text("applications: []\n")
    # No RAY_ADDRESS: with one (the suite's driver sets it) spyre-serve uses that cluster
    # and starts no head, so there is no temp dir to refuse.
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    run = subprocess.run([tool("spyre-serve"), "run", str(config), "--temp-dir", str(long_dir)],
                         capture_output=True, text=True, timeout=60, env=env)
    said = run.stdout + run.stderr
    assert run.returncode != 0 and "is too long" in said and "--temp-dir" in said, said
    assert not list(long_dir.glob("session_*"))  # no Ray was started there
