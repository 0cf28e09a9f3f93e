"""Talking to Slurm: sbatch a script, read the cluster's array limit and a partition's nodes."""

from __future__ import annotations

import itertools
import logging
import os
import re
import shutil
import subprocess
import time

from layertap.slurm.resources import NodeShape
from layertap.slurm.scripts import MASKED
from layertap.slurm.work import DEFAULT_MAX_ARRAY_SIZE
from layertap.storage.errors import ConfigError, UserError
from layertap.storage.redact import redacted

log = logging.getLogger(__name__)


class SlurmError(UserError):
    """sbatch or scontrol is missing or refused the request."""


class Refused(SlurmError):
    """A Slurm command exited non-zero: as a rule it did nothing (sbatch submitted no job; rarely,
    a reply lost after the controller took the job)."""


def require(command: str = "sbatch") -> None:
    """Fail before anything is written when Slurm's commands are not here."""
    if shutil.which(command) is None:
        raise SlurmError(f"{command} is not on PATH: run `layertap submit` where Slurm's commands are "
                         "(a login node), or add --dry-run to print the scripts")


def _run(cmd: list[str]) -> str:
    require(cmd[0])
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise Refused(f"`{' '.join(cmd)}` failed: {(p.stderr or p.stdout).strip() or f'exit {p.returncode}'}")
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
    """Keep the exact script next to the logs it will write, for the record and for resubmitting by
    hand. A script that holds secrets typed on the command line (it must run them: a tool's --api-key,
    or a key in a --setup line or an --sbatch=--export) is readable by its owner alone, and the
    submitter is told to keep them in the environment instead."""
    secret = MASKED in text or redacted(text) != text
    stem = os.path.join(folder, f"{job_name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
    try:
        os.makedirs(folder, exist_ok=True)
        for n in itertools.count():  # a second script of the same name and second (--then-train's) gets its own file
            path = f"{stem}.sbatch" if n == 0 else f"{stem}-{n}.sbatch"
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if secret else 0o666)
                break
            except FileExistsError:
                continue
        with open(fd, "w") as f:
            f.write(text)
    except OSError as e:
        raise ConfigError(f"cannot save the job script under {folder!r} (--logs {os.path.dirname(folder)!r}): "
                          f"{e.strerror or e}; give --logs a folder you can write to") from None
    if secret:
        log.warning("%s holds keys given on the command line (the job runs them): it is readable by you alone, "
                    "and Slurm keeps a copy of it. Export them before `layertap submit` instead (the job inherits "
                    "the environment; docs/SLURM.md, \"Secrets\")", path)
    return path


def sbatch(script: str, after_ok: list[str] | None = None, after_start: list[str] | None = None) -> str:
    """Submit `script`; its job id. With `after_ok`, it starts once all those jobs (every task of
    an array) succeeded, and Slurm cancels it if one of them fails, rather than leave it pending
    forever; with `after_start`, once all those jobs started (or were cancelled)."""
    out = _run(["sbatch", "--parsable", *dependency_options(after_ok or [], after_start or []), script]).strip()
    job = out.split(";", 1)[0]  # "id" or "id;cluster"
    if not job.isdigit():
        raise SlurmError(f"sbatch printed {out!r}, not a job id")
    return job


def unknown_jobs(jobs: list[str]) -> list[str]:
    """Those of `jobs` Slurm does not know (`scontrol show job`: "Invalid job id"), whose afterok
    sbatch drops, starting the dependent job at once; [] where scontrol is not here."""
    if not jobs or shutil.which("scontrol") is None:
        return []
    unknown = []
    for job in jobs:
        p = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True)
        if p.returncode != 0 and "invalid job id" in (p.stderr + p.stdout).lower():
            unknown.append(job)
    if unknown and _hides_jobs():  # another user's job reads as unknown there
        log.warning("job(s) %s are not shown to you, and this cluster hides other users' jobs (PrivateData=jobs): "
                    "if one is a typo, the training starts at once", ", ".join(unknown))
        return []
    return unknown


def _hides_jobs() -> bool:
    """Whether the cluster's PrivateData hides other users' jobs (`scontrol show config`)."""
    try:
        out = _run(["scontrol", "show", "config"])
    except SlurmError:
        return False
    m = re.search(r"^PrivateData\s*=\s*(.*)$", out, re.MULTILINE)
    return bool(m) and "jobs" in m.group(1).lower()


def submit_script(folder: str, job_name: str, text: str, after_ok: list[str] | None = None,
                  after_start: list[str] | None = None) -> str:
    """`save_script` then `sbatch` it; the script removed again if sbatch refuses it (a script
    kept for a job that never existed reads, later, as one that ran); kept where sbatch exited 0
    but printed no job id (a site's wrapper: the job may exist)."""
    path = save_script(folder, job_name, text)
    try:
        return sbatch(path, after_ok, after_start)
    except Refused:
        try:
            os.remove(path)
        except OSError:
            pass
        raise


def cancel(job: str) -> str | None:
    """`scancel job`; why not, if it failed (the caller says so: it is cleaning up after an error)."""
    try:
        _run(["scancel", job])
        return None
    except SlurmError as e:
        return str(e)


def dependency_options(after_ok: list[str], after_start: list[str] | None = None) -> list[str]:
    """sbatch options to start only once every job of `after_ok` succeeded and every job of
    `after_start` started (Slurm's `after`, which a job cancelled before it started also meets)."""
    needs = [f"{kind}:{':'.join(jobs)}" for kind, jobs in (("afterok", after_ok), ("after", after_start)) if jobs]
    if not needs:
        return []
    return [f"--dependency={','.join(needs)}", *(["--kill-on-invalid-dep=yes"] if after_ok else [])]


_GPUS = re.compile(r"(?:^|,)gpu(?::[^:,()]+)?:(\d+)")


def partition_shapes(partition: str | None) -> list[NodeShape]:
    """The smallest node of each partition of `partition` (one, a comma-separated list as sbatch
    takes, or the default partition when None) and its largest GPU count, from `sinfo`; none
    where sinfo is not here or does not know one of them (sbatch judges such a name)."""
    if shutil.which("sinfo") is None:
        return []
    try:
        out = _run(["sinfo", "-h", "-o", "%P|%c|%m|%G|%D"])
    except SlurmError as e:
        log.debug("sinfo failed (%s); sizing without the partition's nodes", e)
        return []
    return parse_partitions(out, partition)


def parse_partitions(out: str, partition: str | None) -> list[NodeShape]:
    """`parse_sinfo` for each name of `--partition a,b`, or [] when sinfo does not know one of
    them: the whole list is then left to sbatch, as one unknown partition is."""
    shapes = []
    for name in partition.split(",") if partition is not None else [None]:
        shape = parse_sinfo(out, name)
        if shape is None:
            return []
        shapes.append(shape)
    return shapes


def parse_sinfo(out: str, partition: str | None) -> NodeShape | None:
    """`sinfo -h -o '%P|%c|%m|%G|%D'` lines, e.g. `gpu*|96|1000000|gpu:h100:8(S:0-1)|16` (`*` marks
    the default partition; `48+` a partition of mixed nodes, at least 48; the node count, a line for
    each kind of node, may be absent)."""
    rows = []
    for line in out.splitlines():
        parts = line.strip().split("|")
        if len(parts) not in (4, 5):
            continue
        name, cpus, mem, gres, count = (parts + [""])[:5]
        if (partition is None and name.endswith("*")) or name.rstrip("*") == partition:
            gpus = [int(n) for n in _GPUS.findall(gres)]
            rows.append((name.rstrip("*"), _leading_int(cpus), _leading_int(mem), max(gpus, default=0), gres,
                         int(count) if count.strip().isdigit() else None))
    if not rows:
        return None
    best = max(rows, key=lambda r: r[3])
    counts = [r[5] for r in rows]
    return NodeShape(partition=rows[0][0], cpus=min(r[1] for r in rows), mem_mb=min(r[2] for r in rows),
                     gpus=best[3], gres=best[4] if best[3] else "", nodes=None if None in counts else sum(counts))


def _leading_int(text: str) -> int:
    m = re.match(r"\d+", text.strip())
    return int(m.group(0)) if m else 0
