"""Talking to Slurm: sbatch a script, read the cluster's array limit."""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import time

from slurm.work import DEFAULT_MAX_ARRAY_SIZE

log = logging.getLogger(__name__)


class SlurmError(Exception):
    """sbatch or scontrol is missing or refused the request."""


def require(command: str = "sbatch") -> None:
    """Fail before anything is written when Slurm's commands are not here."""
    if shutil.which(command) is None:
        raise SlurmError(f"{command} is not on PATH: run `layertap submit` where Slurm's commands are "
                         "(a login node), or add --dry-run to print the scripts")


def _run(cmd: list[str]) -> str:
    require(cmd[0])
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise SlurmError(f"`{' '.join(cmd)}` failed: {(p.stderr or p.stdout).strip() or f'exit {p.returncode}'}")
    return p.stdout


def max_array_size() -> int:
    """The cluster's MaxArraySize (array indices stay below it); Slurm's default if unreadable."""
    try:
        out = _run(["scontrol", "show", "config"])
    except SlurmError as e:
        log.debug("could not read MaxArraySize (%s); assuming %d", e, DEFAULT_MAX_ARRAY_SIZE)
        return DEFAULT_MAX_ARRAY_SIZE
    m = re.search(r"^MaxArraySize\s*=\s*(\d+)", out, re.MULTILINE)
    return int(m.group(1)) if m else DEFAULT_MAX_ARRAY_SIZE


def save_script(folder: str, job_name: str, text: str) -> str:
    """Keep the exact script next to the logs it will write, for the record and for resubmitting by hand."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{job_name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.sbatch")
    with open(path, "w") as f:
        f.write(text)
    return path


def sbatch(script: str, after_ok: list[str] | None = None) -> str:
    """Submit `script`; its job id. With `after_ok`, it starts once all those jobs (every task of
    an array) succeeded, and Slurm cancels it if one of them fails, rather than leave it pending
    forever."""
    out = _run(["sbatch", "--parsable", *dependency_options(after_ok or []), script]).strip()
    job = out.split(";", 1)[0]  # "id" or "id;cluster"
    if not job.isdigit():
        raise SlurmError(f"sbatch printed {out!r}, not a job id")
    return job


def dependency_options(after_ok: list[str]) -> list[str]:
    """sbatch options to start only once every job of `after_ok` succeeded."""
    return [f"--dependency=afterok:{':'.join(after_ok)}", "--kill-on-invalid-dep=yes"] if after_ok else []
