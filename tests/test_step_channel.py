"""The step channel's contract (step_channel.py), without an engine: answers in order under
async scheduling, a rank's error in its own place, a dead or failed rank found while a step
waits. The far end is a real Ray actor running the channel's card side; its worker is a
stand-in that echoes (the real worker's steps are covered by test_engine_tp1/tp2)."""
import sys
import threading

import pytest
import ray

from spyre_serve.vllm_plugin import step_channel

pytestmark = pytest.mark.slow


class EchoWorker:
    """Answers what vLLM's worker wrapper answers, with values that say which request and
    rank they came from; a step named "hang" blocks (a rank stuck in a collective)."""

    def __init__(self, rank: int):
        self.rpc_rank = rank
        self._never = threading.Event()

    def open_step_channel(self, engine_node_id):
        return step_channel.serve(self, self.rpc_rank, engine_node_id)

    def get_node_ip(self):
        return "127.0.0.1"

    def execute_model_ray(self, payload):
        scheduler_output, _ = payload
        if scheduler_output == "hang":
            self._never.wait()
        if scheduler_output == "fail" and self.rpc_rank == 1:
            raise ValueError(f"rank {self.rpc_rank} failed its step")
        return ("output", scheduler_output, self.rpc_rank)

    def execute_method(self, method, *args, **kwargs):
        if method == "steps_answered":
            return step_channel.card_end["steps"]
        raise AttributeError(f"no worker method {method!r}")


@pytest.fixture
def ranks(ray_cluster):
    # The actor's class travels by value: the card actors' processes do not import tests/.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    actors = [ray.remote(num_cpus=0)(EchoWorker).remote(rank) for rank in range(2)]
    channel = step_channel.open_channel(actors)
    assert channel is not None
    yield channel, actors
    channel.close()
    for actor in actors:
        ray.kill(actor)


def test_answers_match_their_steps_when_several_are_in_flight(ranks):
    channel, _ = ranks
    # Async scheduling sends step n+1 before it reads step n.
    futures = [channel.step_future(channel.send("step", (f"s{i}", None))) for i in range(3)]
    assert [f.result() for f in futures] == [("output", f"s{i}", 0) for i in range(3)]
    # Calls queue behind the steps sent before them, on every rank.
    assert channel.call("steps_answered", (), {}, timeout=30) == [3, 3]


def test_a_ranks_error_is_the_answer_to_its_own_step_and_the_next_ones_still_match(ranks):
    channel, _ = ranks
    failing = channel.step_future(channel.send("step", ("fail", None)))
    after = channel.step_future(channel.send("step", ("after", None)))
    with pytest.raises(ValueError, match="rank 1 failed its step"):
        failing.result()
    assert after.result() == ("output", "after", 0)
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
