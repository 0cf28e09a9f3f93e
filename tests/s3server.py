"""A real S3 server for tests and benchmarks: moto's server in a child process on loopback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request


def start_moto_server(timeout_s: float = 30.0) -> tuple[subprocess.Popen, str]:
    """`python -m moto.server` on a free 127.0.0.1 port; returns (process, endpoint URL)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + timeout_s
    while True:
        try:
            urllib.request.urlopen(url + "/moto-api/", timeout=1)
            return proc, url
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                raise RuntimeError("moto server did not start; is moto[server] installed? (pip install 'moto[server]')")
            time.sleep(0.1)


def start_bench_server() -> tuple[subprocess.Popen, str]:
    """moto for a benchmark, with fake credentials set: a user's real keys never reach it."""
    os.environ.update(AWS_ACCESS_KEY_ID="bench-key-id", AWS_SECRET_ACCESS_KEY="bench-secret")
    for var in ("AWS_SESSION_TOKEN", "AWS_PROFILE"):
        os.environ.pop(var, None)
    return start_moto_server()


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
