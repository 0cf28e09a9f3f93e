"""A real S3 server for tests and benchmarks: moto's server in a child process on loopback, or
one given by endpoint (e.g. a Ceph radosgw started by `.ci/rgw.sh`)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


def start_moto_server(timeout_s: float = 30.0, conn_mbps: float | None = None) -> tuple[subprocess.Popen, str]:
    """moto's server (tests/moto_s3.py: conditional writes atomic, as on S3) on a free 127.0.0.1
    port; returns (process, endpoint URL).

    `conn_mbps`: each connection the server accepts sends at most that many MB/s.
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    # glibc's defaults for the server whatever the client runs under, so that a bench run with
    # MALLOC_* settings (docs/LOADER.md, "Memory allocator") measures the client's change alone.
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    pace = [] if conn_mbps is None else ["--pace", str(conn_mbps)]
    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("moto_s3.py")), *pace, "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
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


def start_bench_server(conn_mbps: float | None = None) -> tuple[subprocess.Popen, str]:
    """moto for a benchmark, with fake credentials set: a user's real keys never reach it."""
    os.environ.update(AWS_ACCESS_KEY_ID="bench-key-id", AWS_SECRET_ACCESS_KEY="bench-secret")
    for var in ("AWS_SESSION_TOKEN", "AWS_PROFILE"):
        os.environ.pop(var, None)
    return start_moto_server(conn_mbps=conn_mbps)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()


@dataclass(frozen=True)
class BenchServer:
    endpoint: str
    pid: int | None  # the server process on this machine, for its CPU time; None when not found
    description: str  # for the report
    kind: str = "moto"  # "moto", or the given server's process name ("radosgw"), or "endpoint"

    def section(self, name: str, label: str | None = None) -> str:
        """The docs/benchmarks.md section of bench `name` on this kind of server (and the machine
        `label` names, e.g. "gpu-host"): one per kind and machine."""
        return "-".join(x for x in (name, None if self.kind == "moto" else self.kind, label) if x)

    def heading(self, label: str | None = None) -> str:
        """What to append to the section's title: " (radosgw, gpu-host)", or "" for moto here."""
        words = [x for x in (None if self.kind == "moto" else self.kind, label) if x]
        return f" ({', '.join(words)})" if words else ""


@contextmanager
def bench_server(endpoint: str | None = None, conn_mbps: float | None = None) -> Iterator[BenchServer]:
    """The S3 server a benchmark measures. With `endpoint`, that server, credentials from the
    environment; otherwise a moto server started here with fake credentials and stopped after,
    sending at most `conn_mbps` MB/s per connection if given."""
    if endpoint and conn_mbps is not None:
        raise ValueError("a per-connection rate applies to the moto server started here, not to --endpoint")
    if endpoint:
        pid = listening_pid(urllib.parse.urlsplit(endpoint).port or 80)
        name = _process_name(pid)
        yield BenchServer(endpoint, pid, _describe(endpoint, name), kind=name or "endpoint")
        return
    import moto

    proc, url = start_bench_server(conn_mbps)
    paced = "" if conn_mbps is None else (f", each connection paced at {conn_mbps:g} MB/s by the kernel "
                                          "(SO_MAX_PACING_RATE, tests/moto_s3.py)")
    try:
        yield BenchServer(url, proc.pid, f"moto {moto.__version__} (`python tests/moto_s3.py`) on loopback, "
                                         f"started by the benchmark{paced}")
    finally:
        stop(proc)


def listening_pid(port: int) -> int | None:
    """The process of this machine listening on TCP `port` (Linux /proc; None if not ours to see)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            if f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:  # state LISTEN
                inodes.add(f"socket:[{f[9]}]")
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if any(os.readlink(fd) in inodes for fd in (proc / "fd").iterdir()):
                return int(proc.name)
        except OSError:
            continue
    return None


def _describe(endpoint: str, process: str) -> str:
    if process == "radosgw":
        words = subprocess.run(["radosgw", "--version"], capture_output=True, text=True).stdout.split()
        version = f", Ceph {words[2]}" if len(words) > 2 else ""
        return f"Ceph radosgw at `{endpoint}` (`.ci/rgw.sh`: one monitor, one memstore OSD{version})"
    return f"`{endpoint}` (given with --endpoint{'; server process: ' + process if process else ''})"


def _process_name(pid: int | None) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip() if pid else ""
    except OSError:
        return ""
