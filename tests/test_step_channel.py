"""The step channel's contract (step_channel.py), without an engine: answers in order under
async scheduling, a rank's error in its own place, a dead or failed rank found while a step
waits, no socket folder left behind. And the Ray-call path that ranks on another node than
the EngineCore keep (executor.py's _StepOnAllRanks). The far end is a real Ray actor running
the channel's card side; its worker is a stand-in that echoes (the real worker's steps are
covered by test_engine_tp1/tp2)."""
import os
import sys
import threading
import types

import pytest
import ray

from spyre_serve.vllm_plugin import step_channel

pytestmark = pytest.mark.slow


def Output(request: str, rank: int) -> types.SimpleNamespace:
    """A step's output that says which request and rank it came from, with the two fields
    vLLM's Ray path reads from a ModelRunnerOutput (to copy Ray's read-only buffers) empty.
    A plain type: the channel pickles plainly, and this module does not import in Ray's
    workers (its classes travel by value, which plain pickle cannot load)."""
    return types.SimpleNamespace(request=request, rank=rank, logprobs=None,
                                 aux_output_connector_output=None)


class EchoWorker:
    """Answers what vLLM's worker wrapper answers, with values that say which request and
    rank they came from; a step named "hang" blocks (a rank stuck in a collective).
    `elsewhere`: the rank acts as if on another node than the EngineCore."""

    def __init__(self, rank: int, elsewhere: bool = False):
        self.rpc_rank = rank
        self._never = threading.Event()
        self._elsewhere = elsewhere

    def open_step_channel(self, engine_node_id):
        return step_channel.serve(self, self.rpc_rank,
                                  "another-node" if self._elsewhere else engine_node_id)

    def channel_folder(self):
        return step_channel.folder_of(step_channel.card_end["address"])

    def get_node_ip(self):
        return "127.0.0.1"

    def execute_model_ray(self, payload):
        scheduler_output, _ = payload
        if scheduler_output == "hang":
            self._never.wait()
        if scheduler_output == "fail" and self.rpc_rank == 1:
            raise ValueError(f"rank {self.rpc_rank} failed its step")
        return Output(scheduler_output, self.rpc_rank)

    def execute_method(self, method, *args, **kwargs):
        if method == "steps_answered":
            return step_channel.card_end["steps"]
        raise AttributeError(f"no worker method {method!r}")


@pytest.fixture
def actors(ray_cluster):
    # The actor's class travels by value: the card actors' processes do not import tests/.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    started = [ray.remote(num_cpus=0)(EchoWorker).remote(rank) for rank in range(2)]
    yield started
    for actor in started:
        ray.kill(actor)


@pytest.fixture
def ranks(actors):
    channel = step_channel.open_channel(actors)
    assert channel is not None
    yield channel, actors
    channel.close()


def test_answers_match_their_steps_when_several_are_in_flight(ranks):
    channel, _ = ranks
    # Async scheduling sends step n+1 before it reads step n.
    futures = [channel.step_future(channel.send("step", (f"s{i}", None))) for i in range(3)]
    assert [f.result() for f in futures] == [Output(f"s{i}", 0) for i in range(3)]
    # Calls queue behind the steps sent before them, on every rank.
    assert channel.call("steps_answered", (), {}, timeout=30) == [3, 3]


def test_a_ranks_error_is_the_answer_to_its_own_step_and_the_next_ones_still_match(ranks):
    channel, _ = ranks
    failing = channel.step_future(channel.send("step", ("fail", None)))
    after = channel.step_future(channel.send("step", ("after", None)))
    with pytest.raises(ValueError, match="rank 1 failed its step"):
        failing.result()
    assert after.result() == Output("after", 0)
    with pytest.raises(AttributeError, match="no_such_method"):
        channel.call("no_such_method", (), {}, timeout=30)
    # Rank 1 answered its failed step with the error, not as a step done.
    assert channel.call("steps_answered", (), {}, timeout=30) == [2, 1]


def test_a_killed_rank_fails_the_waiting_step(ranks):
    channel, actors = ranks
    hung = channel.step_future(channel.send("step", ("hang", None)))
    ray.kill(actors[1])
    # Rank 0 would wait forever; the wait asks Ray and raises for the dead rank.
    with pytest.raises(ray.exceptions.RayActorError):
        hung.result()


def test_a_wait_with_a_timeout_ends(ranks):
    channel, _ = ranks
    with pytest.raises(TimeoutError):
        channel.answers(channel.send("step", ("hang", None)), timeout=1)


def test_closing_leaves_no_socket_folder_when_the_ranks_end_at_once(actors):
    channel = step_channel.open_channel(actors)
    folders = [step_channel.folder_of(a) for a in channel._addresses]
    assert all(os.path.isdir(f) for f in folders)
    assert channel.step_future(channel.send("step", ("s", None))).result() == Output("s", 0)
    # As the executor's shutdown does: close, then end the card actors right away.
    channel.close()
    for actor in actors:
        ray.kill(actor)
    assert not any(os.path.exists(f) for f in folders)


def test_a_rank_on_another_node_keeps_ray_calls(ray_cluster):
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    here, there = (ray.remote(num_cpus=0)(EchoWorker).remote(0),
                   ray.remote(num_cpus=0)(EchoWorker).remote(1, elsewhere=True))
    try:
        assert step_channel.open_channel([here, there]) is None
        # The rank that did open its socket keeps no folder.
        assert not os.path.exists(ray.get(here.channel_folder.remote()))
        # The Ray-call path the executor then takes: rank 0's output, once every rank is
        # done; a killed rank fails the waiting step instead of hanging it.
        from spyre_serve.vllm_plugin.executor import _StepOnAllRanks
        step = _StepOnAllRanks([w.execute_model_ray.remote(("s", None)) for w in (here, there)])
        assert step.result() == Output("s", 0)
        hung = _StepOnAllRanks([w.execute_model_ray.remote(("hang", None))
                                for w in (here, there)])
        ray.kill(there)
        with pytest.raises(ray.exceptions.RayActorError):
            hung.result()
    finally:
        for actor in (here, there):
            ray.kill(actor)
