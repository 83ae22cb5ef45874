"""README's main command, as a newcomer runs it: `make serve`, then the README's curl,
then SIGTERM while a stream runs (README: it drains), then `spyre-serve stop`.

Last in the suite (file name): `spyre-serve stop` stops every Ray on the machine.
"""
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import httpx
import psutil
from openai import OpenAI

ROOT = Path(__file__).resolve().parents[1]


def readme_curl() -> str:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(curl .*?)```", text, re.S).group(1)
    return block.replace("\\\n", " ").strip()


def test_make_serve_answers_the_readme_curl(tmp_path):
    import ray
    ray.shutdown()  # the suite's own local cluster: a newcomer's machine has no other Ray
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    log = tmp_path / "make-serve.log"
    server = subprocess.Popen(["make", "serve"], cwd=ROOT, env=env, start_new_session=True,
                              stdout=open(log, "w"), stderr=subprocess.STDOUT)
    started = time.monotonic()
    try:
        deadline = started + 900
        while True:
            assert server.poll() is None, log.read_text()[-5000:]
            try:
                if httpx.get("http://127.0.0.1:8000/v1/models", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "make serve did not answer within 900 s"
            time.sleep(2)
        print(f"make serve answered {time.monotonic() - started:.0f} s after it started")
        curl = subprocess.run(readme_curl(), shell=True, capture_output=True, text=True,
                              timeout=120)
        body = json.loads(curl.stdout)
        assert body["object"] == "text_completion", body
        assert body["model"] == "smollm2-135m-instruct"
        assert 1 <= body["usage"]["completion_tokens"] <= 8

        # SIGTERM to spyre-serve (make's child) while a stream runs: the stream completes,
        # then Serve shuts down and spyre-serve exits.
        spyre_serve = next(p for p in psutil.Process(server.pid).children()
                           if "spyre-serve" in " ".join(p.cmdline()))
        client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused", timeout=120)
        stream = client.completions.create(model="smollm2-135m-instruct", prompt="Once upon a",
                                           max_tokens=48, stream=True,
                                           extra_body={"ignore_eos": True})
        chunks = iter(stream)
        first = next(chunks)
        spyre_serve.send_signal(signal.SIGTERM)
        rest = list(chunks)
        assert rest[-1].choices[0].finish_reason == "length"
        assert len([first, *rest]) == 48
        assert server.wait(180) == 0
        output = log.read_text()
        assert "draining the Serve applications" in output, output[-3000:]
        try:
            httpx.get("http://127.0.0.1:8000/v1/models", timeout=5)
            raise AssertionError("Serve still answers after spyre-serve exited")
        except httpx.HTTPError:
            pass
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
        subprocess.run([str(ROOT / ".venv/bin/spyre-serve"), "stop"], env=env, timeout=120)
