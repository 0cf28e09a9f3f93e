"""A server started for the length of one `layertap regenerate` (`--serve`), as a Slurm task
starts its own vLLM or SGLang next to the client: started, waited for until it answers, and
stopped with everything it spawned when the regeneration ends, however it ends."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shlex
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

from layertap.extract.chat_client import api_base, public_url
from layertap.storage.errors import ConfigError, UserError
from layertap.storage.retry import Backoff

log = logging.getLogger(__name__)

STOP_WAIT_S = 30.0  # after SIGTERM, the server's process group has this long before SIGKILL
# the value: a quoted string as a whole (a key with a space showed its rest), else up to a space
_SECRET_OPTION = re.compile(r"""(--?[\w-]*(?:key|token|secret|password)[\w-]*)(=|\s+)("[^"]*"|'[^']*'|\S+)""",
                            re.IGNORECASE)


class ServerFailed(UserError):
    """The server started by --serve exited or never answered."""


@contextlib.contextmanager
def serving(command: str, endpoint: str, *, timeout_s: float, log_path: str | None = None) -> Iterator[None]:
    """Run `command` (a shell line) until the block ends; enter once `endpoint` lists its models."""
    if not command.strip():
        raise ConfigError("--serve is empty: give the command that starts the server, e.g. "
                          "'vllm serve /models/target --port 8000'")
    out = open(log_path, "ab") if log_path else None
    log.info("starting the server: %s%s", redacted(command), f" (output in {log_path})" if log_path else "")
    # Its own session, so stopping it reaches every process it starts (vLLM's engine and workers).
    proc = subprocess.Popen(["bash", "-c", command], stdout=out, stderr=subprocess.STDOUT if out else None,
                            start_new_session=True)
    try:
        _wait_until_ready(proc, endpoint, timeout_s, command)
        yield
    finally:
        _stop(proc)
        if out is not None:
            out.close()


def redacted(command: str) -> str:
    """`command` with the values of its --api-key, --hf-token, ... options masked: a --serve line
    may carry a key, and keys are never logged."""
    return _SECRET_OPTION.sub(lambda m: f"{m[1]}{m[2]}***", command)


def _wait_until_ready(proc: subprocess.Popen, endpoint: str, timeout_s: float, command: str) -> None:
    url = f"{api_base(endpoint)}/models"
    t0 = time.monotonic()
    wait = Backoff(0.5, 5.0)
    while True:
        if proc.poll() is not None:
            raise ServerFailed(f"the server exited with code {proc.returncode} before it answered at "
                               f"{public_url(endpoint)}: {shlex.split(command)[0]} ... (see its output)")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    log.info("the server answers at %s after %.0f s", public_url(endpoint), time.monotonic() - t0)
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() - t0 > timeout_s:
            raise ServerFailed(f"the server did not answer at {public_url(endpoint)} within {timeout_s:.0f} s "
                               f"(--serve-timeout); is --endpoint the address --serve listens on?")
        wait.sleep()


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group, SIGKILL after STOP_WAIT_S."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(STOP_WAIT_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    log.info("the server stopped (exit %s)", proc.returncode)
