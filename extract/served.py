"""A server started for the length of one `layertap regenerate` (`--serve`), as a Slurm task
starts its own vLLM or SGLang next to the client: started, waited for until it answers, watched
(an exit mid-run stops the run at once, naming its exit code), and stopped with everything it
spawned when the regeneration ends, however it ends."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from urllib.parse import urlsplit

from layertap.extract.chat_client import api_base, auth_header
from layertap.manifests.preemption import shielded
from layertap.storage.errors import ConfigError, UserError
from layertap.storage.redact import public_url, redacted
from layertap.storage.retry import Backoff

log = logging.getLogger(__name__)

STOP_WAIT_S = 30.0  # after SIGTERM, the server's process group has this long before SIGKILL


class ServerFailed(UserError):
    """The server started by --serve exited or never answered."""


@contextlib.contextmanager
def serving(command: str, endpoint: str, *, timeout_s: float, log_path: str | None = None,
            api_key: str | None = None) -> Iterator[Callable[[], None]]:
    """Run `command` (a shell line) until the block ends; enter once `endpoint` answers (asked
    with `api_key`, as the client asks). The block gets a watch: it raises `ServerFailed` once
    the server has exited, so the client stops at once rather than retrying a dead server."""
    if not command.strip():
        raise ConfigError("--serve is empty: give the command that starts the server, e.g. "
                          "'vllm serve /models/target --port 8000'")
    _refuse_taken(endpoint)
    out = open(log_path, "ab") if log_path else None
    log.info("starting the server: %s%s", redacted(command), f" (output in {log_path})" if log_path else "")
    seen = f"its output is in {log_path}" if log_path else "its output is above (no --serve-log)"
    proc: subprocess.Popen | None = None

    def watch() -> None:
        if proc.poll() is not None:
            raise ServerFailed(f"the server (--serve: {_program(command)} ...) exited with code {proc.returncode} "
                               f"during the run; {seen}; the parts written are kept: rerun the "
                               f"same command to continue")

    try:
        with shielded():  # a stop here is raised once `proc` is set, so the finally stops it
            # Its own session, so stopping it reaches every process it starts (vLLM's engine and workers).
            # without --serve-log, stderr: its log (vLLM's goes to stdout) kept out of the status printed on stdout
            proc = subprocess.Popen(["bash", "-c", command], stdout=out if out is not None else 2,  # fd 2: stderr
                                    stderr=subprocess.STDOUT if out else None,
                                    start_new_session=True, preexec_fn=_ended_with_us())
        _wait_until_ready(proc, endpoint, timeout_s, command, api_key, seen)
        yield watch
    finally:
        if proc is not None:
            with shielded():  # a second stop signal (Slurm sends two) broke into the wait and left it running
                _stop(proc)
        if out is not None:
            out.close()


def _ended_with_us() -> Callable[[], None] | None:
    """What the server's process runs before its command, on Linux: it gets SIGTERM when this
    process dies however it dies (SIGKILL, the OOM killer), so a regenerate killed outside a
    Slurm job (whose end kills the job's processes) does not leave a server holding the GPUs.
    bash execs a simple command (`vllm serve ...`), which keeps the signal, and vLLM stops its
    engine on it; a compound --serve line's server outlives bash, and the next run's port
    check names it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the child only calls it
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def arm() -> None:
        prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # this process died before the line above
            os.kill(os.getpid(), signal.SIGTERM)

    return arm


def _refuse_taken(endpoint: str) -> None:
    """Refuse to start where something already listens at --endpoint's host and port: the server
    started would fail to bind ("Address already in use") while the one there answered every
    request (a server a killed regenerate left running, or another model's), and the run went on
    against it, exit 0."""
    parts = urlsplit(endpoint)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        with socket.create_connection((parts.hostname or "localhost", port), timeout=2):
            pass
    except OSError:
        return
    raise ServerFailed(f"something already listens at {public_url(endpoint)} before --serve started its server: a "
                       "server a killed `layertap regenerate` left running (its processes hold the GPUs too), or "
                       "another service on that port. Stop it, or give --serve and --endpoint another port")


def _program(command: str) -> str:
    """The program a --serve line starts, past its NAME=value assignments (which may hold keys),
    whatever its quoting (bash itself says what is wrong with a quote, in the server's output)."""
    try:
        words = shlex.split(command)
    except ValueError:  # an unbalanced quote
        words = command.split()
    return next((w for w in words if not re.match(r"\w+=", w)), "?")


def _wait_until_ready(proc: subprocess.Popen, endpoint: str, timeout_s: float, command: str, api_key: str | None,
                      seen: str) -> None:
    """Until GET /models answers 200, or 401/403: the server is up and refuses the key; the client's
    own check then says so, rather than this waiting out --serve-timeout. The URL has no
    user:password (sent as a header, as the client sends it)."""
    query = urlsplit(endpoint).query
    request = urllib.request.Request(f"{api_base(endpoint)}/models" + (f"?{query}" if query else ""),
                                     headers=auth_header(endpoint, api_key))
    t0 = time.monotonic()
    wait = Backoff(0.5, 5.0)
    while True:
        if proc.poll() is not None:
            raise ServerFailed(f"the server exited with code {proc.returncode} before it answered at "
                               f"{public_url(endpoint)}: {_program(command)} ... ({seen})")
        try:
            with urllib.request.urlopen(request, timeout=5) as r:
                if r.status == 200 and proc.poll() is None:  # ours, still running: not another's in its place
                    log.info("the server answers at %s after %.0f s", public_url(endpoint), time.monotonic() - t0)
                    return
        except urllib.error.HTTPError as e:
            e.close()
            if e.code in (401, 403):
                log.info("the server answers at %s after %.0f s, and refuses the API key (%d)", public_url(endpoint),
                         time.monotonic() - t0, e.code)
                return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() - t0 > timeout_s:
            raise ServerFailed(f"the server did not answer at {public_url(endpoint)} within {timeout_s:.0f} s "
                               f"(--serve-timeout); is --endpoint the address --serve listens on?")
        wait.sleep()


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group, SIGKILL after STOP_WAIT_S to what is left of it. The
    group, also when the server itself has exited (it died mid-run, or before it answered): its
    workers (vLLM's engine processes) may outlive it, holding the GPUs the rerun needs."""
    exited = proc.poll() is not None
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_WAIT_S
    while (proc.poll() is None or _group_alive(proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    if proc.poll() is None or _group_alive(proc.pid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    if not exited:
        log.info("the server stopped (exit %s)", proc.returncode)


def _group_alive(pgid: int) -> bool:
    """Whether a process of group `pgid` still runs (a zombie, waiting for its parent to reap it,
    does not: it holds nothing). Without /proc: whether the group has members at all."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        try:
            os.killpg(pgid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False
    for pid in filter(str.isdigit, entries):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rpartition(")")[2].split()  # after the command's name, which may hold spaces
        except OSError:  # gone meanwhile
            continue
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] != "Z":
            return True
    return False
