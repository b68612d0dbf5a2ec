"""The wheel a user pip-installs: `make wheel` builds the manylinux_2_28 abi3 wheel (the
one the release workflow publishes), auditwheel accepts it, and installed into a fresh
virtual environment it serves a request. Slow: the first build compiles HiGHS with zig."""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, body: dict | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    with urllib.request.urlopen(urllib.request.Request(url, data, headers), timeout=60) as r:
        return json.loads(r.read())


@pytest.mark.slow
def test_the_manylinux_wheel_installs_in_a_fresh_venv_and_serves(tmp_path):
    dist = tmp_path / "dist"
    built = subprocess.run(
        ["make", "wheel", f"WHEEL_DIR={dist}", f"PYTHON={sys.executable}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    assert built.returncode == 0, built.stderr[-4000:]
    (wheel,) = dist.glob("dilaserve-*.whl")
    assert wheel.name.endswith(f"-cp311-abi3-manylinux_2_28_{platform.machine()}.whl")
    assert f'platform tag: "manylinux_2_28_{platform.machine()}"' in built.stdout

    # A fresh environment sees the installed dependencies but gets the wheel's dilaserve.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", venv], check=True)
    python, bindir = venv / "bin" / "python", venv / "bin"
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", wheel], check=True)
    where = subprocess.run(
        [python, "-c", "import dilaserve._core as c; print(c.__file__)"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert str(venv) in where

    port = _free_port()
    server = subprocess.Popen(
        [bindir / "dilaserve", "serve", "--port", str(port), "--instances", "1x1"],
        cwd=tmp_path,
        env=os.environ | {"PATH": f"{bindir}:{os.environ['PATH']}"},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                if _get(f"{url}/ready")["ready"]:
                    break
            except OSError:
                pass
            assert server.poll() is None and time.monotonic() < deadline
            time.sleep(0.5)
        body = {"model": "dilaserve-tiny", "prompt": "12345+67890=", "max_tokens": 8}
        answer = _get(f"{url}/v1/completions", body)
        assert answer["choices"][0]["text"] == "80235"
    finally:
        server.terminate()
        server.wait(60)
