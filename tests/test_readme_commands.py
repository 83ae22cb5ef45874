"""README's commands, run as a newcomer runs them: an empty HOME (no ~/.ray token), a Ray temp
dir of the test's own, no RAY_* settings, no Ray of earlier tests.

`make serve` starts from a HOME with nothing in it, the demo model's cache included: it is
the first command README gives. The commands README gives after it find the demo model that
a first run converted into ~/.cache/spyre_serve, as a newcomer's HOME would have it (the
first of them to run in this module converts it); converting it once per test cost ~40 s
each in CI for nothing the tests check.

Each test stops exactly what it started (by its own Ray temp dir, never `ray stop`), so it
passes alone, in any order, and beside the suite's own Ray cluster.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import psutil
import pytest
from openai import OpenAI

from support import (ROOT, VENV_BIN, newcomer_env, port_open, processes_in_sessions,
                     processes_mentioning, wait_for)

pytestmark = pytest.mark.slow

API = "http://127.0.0.1:8000"
MODEL = "smollm2-135m-instruct"
README = (ROOT / "README.md").read_text()
# What Ray and vLLM processes print when a signal kills them (glog's failure handler):
# a clean stop must not look like a crash.
CRASH_DUMP = re.compile(r"\*\*\* (SIGTERM|SIGINT|SIGSEGV) received|PC: @")


def readme_block(first_word: str) -> list[str]:
    """The command lines of README's ```bash block whose first command starts so."""
    for block in re.findall(r"```bash\n(.*?)```", README, re.S):
        lines = [line.split("  #")[0].strip() for line in block.replace("\\\n", " ").splitlines()]
        lines = [line for line in lines if line and not line.startswith("#")]
        if lines and lines[0].startswith(first_word):
            return lines
    raise AssertionError(f"README has no bash block starting with {first_word!r}")


def readme_curl() -> dict:
    (curl,) = readme_block("curl")
    done = subprocess.run(curl, shell=True, capture_output=True, text=True, timeout=120)
    body = json.loads(done.stdout)
    assert body["object"] == "text_completion", body
    assert body["model"] == MODEL
    assert 1 <= body["usage"]["completion_tokens"] <= 8
    return body


class Newcomer:
    """An empty HOME and a Ray temp dir of its own; `env` is the shell a newcomer has,
    `activated` the same after `. .venv/bin/activate`. With `model_cache`, the HOME's
    ~/.cache/spyre_serve is that folder: the demo model an earlier `make serve` converted."""

    def __init__(self, model_cache: Path | None = None):
        self.root = Path(tempfile.mkdtemp(prefix="nc-", dir="/tmp"))  # short: Ray's sockets
        (self.root / "home").mkdir()
        (self.root / "rt").mkdir()
        if model_cache is not None:
            (self.root / "home" / ".cache").mkdir()
            (self.root / "home" / ".cache" / "spyre_serve").symlink_to(model_cache)
        self.env = newcomer_env(self.root / "home", self.root / "rt")
        self.activated = {**self.env, "VIRTUAL_ENV": str(ROOT / ".venv"),
                          "PATH": f"{VENV_BIN}:{self.env['PATH']}"}

        self.sessions: set[int] = set()  # every command runs in a session of its own

    def run(self, command: str, timeout: float = 120, env=None) -> subprocess.CompletedProcess:
        process = self.popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        stdout, stderr = process.communicate(timeout=timeout)
        return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)

    def popen(self, command, env=None, **kwargs) -> subprocess.Popen:
        process = subprocess.Popen(command, shell=isinstance(command, str), cwd=ROOT,
                                   env=env or self.activated, text=True,
                                   start_new_session=True, **kwargs)
        self.sessions.add(process.pid)
        return process

    def ray_tools_see(self, app: str) -> None:
        """`serve status`, `serve config`, `ray status` and a Python driver, no extra steps."""
        status = wait_for("serve status to show the app RUNNING",
                          lambda: (out := self.run("serve status").stdout)
                          and re.search(rf"{app}:\s*\n\s*status: RUNNING", out) and out, 60, 2)
        assert "SpyreLLM" in status
        assert f"name: {app}" in self.run("serve config").stdout
        wait_for("ray status to list the cards",
                 lambda: re.search(r"/4\.0 spyre", self.run("ray status").stdout), 60, 2)
        driver = self.run(f"{VENV_BIN}/python -c 'import ray; ray.init(); "
                          "print(ray.cluster_resources()[\"spyre\"])'")
        assert driver.stdout.strip().splitlines()[-1] == "4.0", driver.stderr[-2000:]

    def leftovers(self) -> list[int]:
        """What the newcomer's commands started and is still running (Ray's daemons too)."""
        return sorted(set(processes_in_sessions(self.sessions))
                      | set(processes_mentioning(str(self.root / "rt"))))

    def cleanup(self) -> None:
        for pid in self.leftovers():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        wait_for("the newcomer's processes to go", lambda: not self.leftovers(), 30, 0.5)
        wait_for("port 8000 to close", lambda: not port_open(8000), 30, 0.5)


@pytest.fixture(scope="module")
def converted_demo_model(tmp_path_factory) -> Path:
    """The ~/.cache/spyre_serve every test after `make serve` shares (filled by the first)."""
    return tmp_path_factory.mktemp("spyre-serve-cache")


@pytest.fixture
def pristine_newcomer(converted_demo_model):
    """Afterwards the demo model it converted is what the later tests' HOMEs have."""
    assert not port_open(8000), "port 8000 is taken: README's commands need it"
    person = Newcomer()
    yield person
    person.cleanup()
    if not any(converted_demo_model.iterdir()):
        for folder in (Path(person.env["HOME"]) / ".cache" / "spyre_serve").glob("*"):
            shutil.move(folder, converted_demo_model / folder.name)


@pytest.fixture
def newcomer(converted_demo_model):
    assert not port_open(8000), "port 8000 is taken: README's commands need it"
    person = Newcomer(model_cache=converted_demo_model)
    yield person
    person.cleanup()


def assert_head_drained(head_output: str) -> None:
    """The head's SIGTERM drain (Ray's `ray start --block`) found its node idle: no actor of
    ours outlived the drained apps to hold it the full RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S
    (the warm-start catalog's detached actor did, for 30 s, until `end_catalog`)."""
    assert "did not finish draining" not in head_output, head_output[-3000:]
    assert "Local node finished draining" in head_output, head_output[-3000:]


def stream_then_signal(process: psutil.Process | subprocess.Popen, sig=signal.SIGTERM):
    """SIGTERM while a 48-token stream runs: the stream must still complete.

    Tokens are counted from the stream's usage, not its chunks: vLLM merges the tokens a
    slow reader has not taken yet into one chunk, so chunks can be fewer than tokens.
    """
    client = OpenAI(base_url=f"{API}/v1", api_key="unused", timeout=120)
    stream = client.completions.create(model=MODEL, prompt="Once upon a", max_tokens=48,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    chunks = iter(stream)
    first = next(chunks)
    process.send_signal(sig)
    every = [first, *chunks]
    finishes = [c.choices[0].finish_reason for c in every if c.choices]
    assert finishes[-1] == "length", finishes
    assert every[-1].usage is not None and every[-1].usage.completion_tokens == 48, every[-1]


@pytest.mark.timeout(1800)
def test_make_serve_from_a_pristine_home(pristine_newcomer, tmp_path):
    newcomer = pristine_newcomer
    assert not any(Path(newcomer.env["HOME"]).iterdir())
    log = tmp_path / "make-serve.log"
    started = time.monotonic()
    server = newcomer.popen(["make", "serve"], env=newcomer.env, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT)
    try:
        ready = wait_for("make serve's READY line",
                         lambda: (server.poll() is None or pytest.fail(log.read_text()[-5000:]))
                         and re.search(r"spyre-serve: READY: .*", log.read_text()), 900, 1)
        print(f"make serve was ready {time.monotonic() - started:.0f} s after it started "
              f"(model conversion included): {ready.group(0)}")
        assert f"OpenAI API at {API}/v1, model \"{MODEL}\"" in ready.group(0)
        blocks = re.search(r"KV handshake: (\d+) blocks of 64 tokens per card \(1 rank\(s\), "
                           r"limited by rank 0\)", ready.group(0))
        assert blocks, ready.group(0)
        status = httpx.get(f"{API}/spyre/status", timeout=60).json()
        assert int(blocks.group(1)) == status["num_blocks"] == status["reports"][0]["num_blocks"]
        readme_curl()
        newcomer.ray_tools_see("spyre-llm")

        spyre_serve = next(p for p in psutil.Process(server.pid).children()
                           if "spyre-serve" in " ".join(p.cmdline()))
        stream_then_signal(spyre_serve)
        assert server.wait(180) == 0
        output = log.read_text()
        assert "draining the Serve applications" in output, output[-3000:]
        assert not CRASH_DUMP.search(output), output[-5000:]
        assert_head_drained(output)
        # The head this run started stops with it, and nothing else of it stays.
        wait_for("every process of make serve's Ray to exit", lambda: not newcomer.leftovers(),
                 60, 1)
        assert not port_open(8000)
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGKILL)
            server.wait(30)


def test_ray_start_then_serve_run_as_readme_says(newcomer, tmp_path):
    """The mission's own command, on a Ray cluster no spyre-serve started."""
    start, run = readme_block("ray start")
    assert start == "ray start --head --resources='{\"spyre\": 4}'" and run == \
        "serve run serve_config.yaml"
    done = newcomer.run(start)
    assert done.returncode == 0, done.stderr[-3000:]
    log = tmp_path / "serve-run.log"
    server = newcomer.popen(shlex.split(run), stdout=open(log, "w"), stderr=subprocess.STDOUT)
    try:
        wait_for("serve run to answer", lambda: (server.poll() is None or pytest.fail(
            log.read_text()[-5000:])) and _answers(), 900, 2)
        readme_curl()
        newcomer.ray_tools_see("spyre-llm")
        assert "spyre_serve: no node of this Ray cluster declares" not in log.read_text()
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(120)


def test_spyre_serve_start_deploy_status_stop(newcomer):
    """`spyre-serve start` keeps Ray's dashboard: `serve deploy` and `serve status` work;
    `spyre-serve stop` stops that head and nothing else."""
    commands = readme_block("spyre-serve start")
    assert commands == ["spyre-serve start", "serve deploy serve_config.yaml", "serve status",
                        "spyre-serve stop"], commands
    start, deploy, _, stop = commands
    done = newcomer.run(start)
    assert done.returncode == 0, done.stderr[-3000:]
    done = newcomer.run(deploy)
    assert done.returncode == 0, done.stderr[-3000:]
    wait_for("the deployed app to answer", _answers, 900, 2)
    readme_curl()
    newcomer.ray_tools_see("spyre-llm")
    done = newcomer.run(stop, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "stopped the Ray head" in done.stderr
    assert not CRASH_DUMP.search(done.stdout + done.stderr)
    (head_log,) = (newcomer.root / "rt").rglob("spyre-serve-head.log")
    assert_head_drained(head_log.read_text())
    wait_for("every process of that head to exit", lambda: not newcomer.leftovers(), 60, 1)


def test_no_node_declares_cards_is_named_within_a_minute(newcomer, tmp_path):
    done = newcomer.run("ray start --head --disable-usage-stats")
    assert done.returncode == 0, done.stderr[-3000:]
    log = tmp_path / "serve-run.log"
    server = newcomer.popen(["serve", "run", "serve_config.yaml"], stdout=open(log, "w"),
                            stderr=subprocess.STDOUT)
    try:
        started = time.monotonic()
        line = wait_for("the message naming the missing resource", lambda: re.search(
            r"spyre_serve: no node of this Ray cluster declares 1 `spyre` resource.*", 
            log.read_text()), 75, 1)
        print(f"named after {time.monotonic() - started:.0f} s: {line.group(0)}")
        assert "spyre-serve start" in line.group(0)
        assert "--resources='{\"spyre\": 4}'" in line.group(0)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(120)


def _answers() -> bool:
    try:
        return httpx.get(f"{API}/v1/models", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def test_token_auth_when_asked_for(newcomer):
    """README's token route: RAY_AUTH_MODE=token makes spyre-serve create the token (empty
    HOME) and start a cluster that refuses clients without it."""
    token = {"RAY_AUTH_MODE": "token"}
    done = newcomer.run("spyre-serve start --cards 2", env={**newcomer.activated, **token})
    assert done.returncode == 0, done.stderr[-3000:]
    token_file = Path(newcomer.env["HOME"]) / ".ray" / "auth_token"
    assert token_file.is_file() and token_file.stat().st_size >= 32
    try:
        with_token = wait_for("ray status with the token", lambda: re.search(
            r"/2\.0 spyre", subprocess.run("ray status", shell=True, capture_output=True,
                                           text=True, env={**newcomer.activated, **token},
                                           timeout=60).stdout), 60, 2)
        assert with_token
        without = newcomer.run("ray status", env={**newcomer.activated,
                                                  "RAY_AUTH_MODE": "disabled"})
        assert without.returncode != 0 and "Authentication" in without.stderr
        serve = newcomer.run("serve status", env={**newcomer.activated, **token})
        assert serve.returncode == 0 and "applications: {}" in serve.stdout, serve.stderr
    finally:
        done = newcomer.run("spyre-serve stop", env={**newcomer.activated, **token})
    assert done.returncode == 0, done.stderr[-3000:]
    wait_for("every process of that head to exit", lambda: not newcomer.leftovers(), 60, 1)
