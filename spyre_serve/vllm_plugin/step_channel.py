"""The step channel: engine steps and worker calls from the EngineCore to its card actors
over a ZeroMQ socket each, once the engine serves.

Why not a Ray actor call per step: a Ray call and its result cost ~1.0-1.3 ms here (gRPC
between two core workers plus the actor's task loop; bench/README), a step of the tiny
model ~5 ms. Why not Ray's compiled graph: its reader spins (EngineCore 0.98 of a core on
2 cores). A ZeroMQ PAIR socket over a Unix socket blocks in the kernel while it waits and
takes ~0.17 ms a round trip. ZeroMQ is what vLLM itself uses between its frontend and its
EngineCore; what is ours is only the small protocol below.

Protocol, per rank, in order: the EngineCore sends (kind, payload) to every rank; each
rank answers every message, in the order received, with (ok, value). kind "step" runs
vLLM's `execute_model_ray` (rank 0 answers the output, the others None), "call" a worker
method (what collective_rpc sends). Once the channel is open every call to the ranks goes
through it, so steps and calls keep the order the EngineCore made them in, as one queue
of Ray calls did.

The socket is a file in a private (0700) directory of the card's node, so only processes
of the same user can reach it; ranks on another node than the EngineCore (possible for an
offline engine's PACK placement group) keep Ray calls (`open_channel` returns None).
A dead rank is found by a Ray call to its actor whenever a wait passes POLL_SECONDS.
"""
from __future__ import annotations

import os
import pickle
import shutil
import tempfile
import threading
import time
import traceback
from concurrent.futures import Future

import cloudpickle
import ray
import zmq

from spyre_serve import get_logger
from spyre_serve.vllm_plugin.settings import node_scratch

logger = get_logger(__name__)
# How long the EngineCore waits on a rank's answer before asking Ray whether it is alive.
POLL_SECONDS = 0.2
# Unix socket paths are limited to 107 bytes.
_MAX_SOCKET_PATH = 100


# ---- card side (inside a card actor) ------------------------------------------------

# This rank's end, as its status reports it (SpyreWorker.spyre_status).
card_end = {"address": None, "steps": 0, "calls": 0}


def serve(wrapper, rank: int, engine_node_id: str) -> str | None:
    """Bind this rank's socket and answer on a thread of its own; return its address, or
    None when the EngineCore is on another node (a Unix socket reaches only this one).
    The actor's Ray thread stays free, so Ray can still reach the actor (liveness)."""
    if ray.get_runtime_context().get_node_id() != engine_node_id:
        return None
    base = node_scratch("steps")
    os.makedirs(base, exist_ok=True)
    folder = tempfile.mkdtemp(prefix=f"rank{rank}-", dir=base)  # mode 0700
    path = os.path.join(folder, "s")
    if len(path) > _MAX_SOCKET_PATH:
        raise OSError(f"step channel socket path too long for a Unix socket: {path}")
    context = zmq.Context()
    socket = context.socket(zmq.PAIR)
    socket.bind(f"ipc://{path}")
    card_end["address"] = f"ipc://{path}"
    threading.Thread(target=_answer, args=(wrapper, rank, socket, folder),
                     name="spyre-step-channel", daemon=True).start()
    return f"ipc://{path}"


def _answer(wrapper, rank: int, socket, folder: str) -> None:
    try:
        while True:
            kind, payload = pickle.loads(socket.recv())
            if kind == "close":
                break
            try:
                if kind == "step":
                    value = wrapper.execute_model_ray(payload)
                    value = value if rank == 0 else None  # only rank 0's output is read
                    card_end["steps"] += 1
                else:
                    method, args, kwargs = payload
                    if isinstance(method, bytes):
                        method = cloudpickle.loads(method)
                    card_end["calls"] += 1
                    value = wrapper.execute_method(method, *args, **kwargs)
                socket.send(_dumps((True, value)))
            except Exception as e:  # the rank's failure goes to the EngineCore, as Ray's would
                socket.send(_dumps((False, _portable(e))))
    except BaseException:
        # Without its channel the rank can only hang the engine: end the process, so Ray
        # reports the actor dead and the EngineCore's liveness check fails the engine.
        logger.critical("rank %d: step channel failed, ending the card actor\n%s",
                        rank, traceback.format_exc())
        os._exit(1)
    finally:
        socket.close(linger=0)
        shutil.rmtree(folder, ignore_errors=True)


def _portable(e: Exception) -> Exception:
    """The error itself if it survives the trip (some exceptions pickle but do not load),
    else its text."""
    try:
        pickle.loads(_dumps(e))
        return e
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {e}\n{traceback.format_exc()}")


def folder_of(address: str) -> str:
    """The private folder a rank's socket address lives in."""
    return os.path.dirname(address.removeprefix("ipc://"))


def _dumps(obj) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


# ---- engine side (in the EngineCore) ---------------------------------------------------

class StepChannel:
    """The EngineCore's end: one socket per rank, answers matched to requests by order."""

    def __init__(self, workers, addresses: list[str]):
        self._workers = workers
        self._addresses = addresses
        self._context = zmq.Context()
        self._sockets = []
        for address in addresses:
            socket = self._context.socket(zmq.PAIR)
            socket.connect(address)
            self._sockets.append(socket)
        self._poller = zmq.Poller()
        for socket in self._sockets:
            self._poller.register(socket, zmq.POLLIN)
        self._sent = 0
        self._answered = [0] * len(self._sockets)  # per rank: answers received so far
        self._answers: dict[int, list] = {}  # request number -> per-rank (ok, value)

    def send(self, kind: str, payload) -> int:
        """Send to every rank; return the request's number."""
        data = _dumps((kind, payload))
        for socket in self._sockets:
            socket.send(data, copy=False)
        self._sent += 1
        return self._sent - 1

    def step_future(self, number: int) -> "StepFuture":
        return StepFuture(self, number)

    def call(self, method, args: tuple, kwargs: dict, timeout: float | None) -> list:
        sent = method if isinstance(method, str) else cloudpickle.dumps(method)
        return self.answers(self.send("call", (sent, args, kwargs)), timeout)

    def answers(self, number: int, timeout: float | None = None) -> list:
        """Every rank's answer to request `number`; raise the first rank's error at once
        (a failed rank may leave the others blocked in a collective with it)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            got = self._answers.get(number)
            if got is not None:
                for ok, value in filter(None, got):
                    if not ok:
                        raise value
                if None not in got:
                    del self._answers[number]
                    return [value for _, value in got]
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"ranks did not answer within {timeout} s")
            ready = dict(self._poller.poll(int(POLL_SECONDS * 1000)))
            if not ready:
                self._check_alive()
                continue
            for rank, socket in enumerate(self._sockets):
                if socket in ready:
                    self._take(rank, pickle.loads(socket.recv()))

    def _take(self, rank: int, answer) -> None:
        number = self._answered[rank]
        self._answered[rank] += 1
        self._answers.setdefault(number, [None] * len(self._sockets))[rank] = answer

    def _check_alive(self) -> None:
        """A rank that died answers nothing: ask Ray about its actor (raises if it is gone)."""
        refs = [worker.get_node_ip.remote() for worker in self._workers]
        try:
            ray.get(refs, timeout=60)
        except ray.exceptions.GetTimeoutError:
            pass  # slow to answer is not dead: keep waiting

    def close(self) -> None:
        for socket in self._sockets:
            try:
                socket.send(_dumps(("close", None)), flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            socket.close(linger=0)
        self._context.term()
        # The ranks remove their folders when they read "close", but the executor ends
        # their actors right after sending it: this node's EngineCore removes them too.
        for address in self._addresses:
            shutil.rmtree(folder_of(address), ignore_errors=True)


class StepFuture(Future):
    """A step's result as vLLM's EngineCore reads it (`result()`), under async scheduling
    read after the next step was sent."""

    def __init__(self, channel: StepChannel, number: int):
        super().__init__()
        self._channel, self._number = channel, number

    def result(self, timeout=None):
        return self._channel.answers(self._number, timeout)[0]


def open_channel(workers) -> StepChannel | None:
    """Open every rank's channel, or None (Ray calls stay) when a rank is on another node
    than the EngineCore or cannot open one."""
    here = ray.get_runtime_context().get_node_id()
    try:
        addresses = ray.get([worker.open_step_channel.remote(here) for worker in workers],
                            timeout=60)
    except Exception as e:
        logger.warning("step channel not opened, engine steps stay Ray calls: %s", e)
        addresses = [None]
    if None in addresses:
        # A rank that did open one waits on it harmlessly (Ray calls reach it as before);
        # its socket folder goes now.
        for address in filter(None, addresses):
            shutil.rmtree(folder_of(address), ignore_errors=True)
        logger.info("engine steps stay Ray calls (a card actor is on another node than "
                    "the EngineCore, or could not open its channel)")
        return None
    return StepChannel(workers, addresses)
