"""Whether the process holding a lease has exited, when it ran on this very machine.

A lease goes stale only after its TTL: that is how a worker on another node learns that its
holder died. On the holder's own machine there is a faster answer: a process restarted right
after a SIGKILL (a user's rerun, a requeued job landing on the same node) need not wait a TTL for
its dead predecessor's lease. Only a holder in this machine's own PID namespace since its boot
(same host name, boot id and /proc/self/ns/pid: containers that share a host name but not their
PIDs are not "here", nor are two machines of one name, whose initial namespaces share an inode)
whose PID is gone, or a zombie, counts; anything else is left to age out.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from typing import Any


def slurm_job() -> str | None:
    """This process's Slurm job as squeue and sacct name it: `123_4` for task 4 of array job 123
    (whose SLURM_JOB_ID is the task's own number, which no listing shows), else SLURM_JOB_ID."""
    job = os.environ.get("SLURM_JOB_ID")
    if job and os.environ.get("SLURM_ARRAY_TASK_ID"):
        job = f"{os.environ.get('SLURM_ARRAY_JOB_ID', job)}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    return job


def pid_namespace() -> str | None:
    """This process's PID namespace on this machine since its boot ('BOOT_ID/INODE', from /proc),
    None where /proc does not say."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}/{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return None


def gone_from_here(holder: Mapping[str, Any]) -> bool:
    """Whether `holder` (a lease payload's `host`, `pid`, `pid_ns`) ran here and has exited."""
    pid, ns = holder.get("pid"), holder.get("pid_ns")
    if holder.get("host") != socket.gethostname() or ns is None or ns != pid_namespace():
        return False
    if not isinstance(pid, int) or pid <= 0 or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's process: running
        return False
    try:  # killed but not yet reaped by its parent: a zombie ('Z' after the command's name)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] == "Z"
    except (OSError, IndexError):
        return False
