"""What the ranks of one training job tell each other, and the checks that they agree.

Each function is a collective: every rank calls it, at the same point, or the job hangs in it.
The numbers travel as tensors on the ranks' device (NCCL moves device memory; gloo host memory),
other values as JSON bytes (no pickle). With one process each returns at once.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from layertap.manifests.train_output import RESUBMIT
from layertap.storage.errors import InputError, UserError
from layertap.storage.units import id_ranges


def per_rank(acc: Any, values: Sequence[float], dtype: torch.dtype = torch.float64) -> list[list]:
    """Every rank's `values` (as many on each rank), in rank order: one gather."""
    t = torch.tensor(list(values), dtype=dtype, device=acc.device)
    if acc.num_processes > 1:
        t = acc.gather(t)
    return t.view(acc.num_processes, -1).cpu().tolist()


def from_rank_0(acc: Any, value: Any, group: Any = None) -> Any:
    """Rank 0's JSON-ready `value` on every rank, sent as JSON bytes; over `group` (a gloo group of
    every rank, `host_group`: host memory, callable from a thread of its own) when given."""
    if acc.num_processes == 1:
        return value
    import torch.distributed as dist

    device = torch.device("cpu") if group is not None else acc.device
    data = json.dumps(value).encode() if acc.process_index == 0 else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(size, src=0, group=group)
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(int(size), dtype=torch.uint8)
    buf = buf.to(device)
    dist.broadcast(buf, src=0, group=group)
    return json.loads(bytes(buf.cpu().numpy()))


def host_group(acc: Any) -> Any:
    """A gloo group of every rank (collective: every rank calls it), for exchanges that happen off
    the training thread (the loader's prefetch thread): the default group's NCCL calls belong to
    the training thread's order. None with one process."""
    if acc.num_processes == 1:
        return None
    import torch.distributed as dist

    return dist.new_group(backend="gloo")


def broadcast_tensors(acc: Any, groups: Iterable[dict[str, torch.Tensor]]) -> None:
    """Rank 0's tensors into every rank's (allocated alike: same names and shapes), one broadcast
    a tensor in name order, through the device. Lets rank 0 alone read a checkpoint: at a 27B
    target's shapes it is ~22 GB, and 1,000 ranks each reading it took ~22 TB off the store."""
    if acc.num_processes == 1:
        return
    import torch.distributed as dist

    root, on_host = acc.process_index == 0, acc.device.type == "cpu"
    for tensors in groups:
        for name in sorted(tensors):
            t = tensors[name]
            buf = t if on_host else t.to(acc.device) if root else torch.empty_like(t, device=acc.device)
            dist.broadcast(buf, src=0)
            if not root and buf is not t:
                t.copy_(buf)


def raise_if_any_refused(acc: Any, refused: BaseException | None, what: str) -> None:
    """Raise `refused` on its rank, and on the others an error naming the ranks that refused
    `what`: a rank that stops alone leaves the others in the next collective, which ends in a
    connection error and a traceback, not the refusal's message and exit code."""
    flags = per_rank(acc, [float(refused is not None)])
    if refused is not None:
        raise refused
    bad = [rank for rank, (flag,) in enumerate(flags) if flag]
    if bad:
        raise InputError(f"rank(s) {id_ranges(bad, 10)} refused {what}: their error says why")


def agree_on_checkpoint(acc: Any, step: int | None, failed: BaseException | None, out: str) -> None:
    """Every rank read the same checkpoint `step` (None: none), or every rank stops: ranks
    resuming from different ones (an --out on a folder local to each node; latest.json changed
    between their reads) would call different collectives and hang, and one that failed to read
    it would leave the others waiting in the first."""
    rows = per_rank(acc, [float(failed is not None), float(step if step is not None else -1)])
    if failed is not None:
        raise failed
    bad = [rank for rank, (f, _) in enumerate(rows) if f]
    if bad:
        raise InputError(f"rank(s) {id_ranges(bad, 10)} could not read the latest checkpoint of {out}: their error says why")
    steps = sorted({int(s) for _, s in rows})
    if len(steps) > 1:
        raise InputError(f"the ranks found different checkpoints in {out} (steps {steps}; -1: none): every rank "
                         "must see the same --out (not a folder local to each node), and nothing else may write "
                         "to it during the resume")


# How torch says a collective failed where it raises no DistError: gloo's "Connection closed by
# peer [...]. This is typically caused by a remote worker crashing", a reset or broken socket
_COLLECTIVE_FAILED = re.compile(r"\b(gloo|nccl)\b|connection (closed|reset) by peer|broken pipe", re.IGNORECASE)


class RanksLost(UserError):
    """A collective between the training ranks failed: another rank stopped, died or hung."""


def collective_failed(e: BaseException) -> bool:
    """Whether `e` is torch's report of a collective that failed between the ranks (a peer that
    exited, was killed or hung past the backend's timeout): a `DistError` where the backend
    types it (NCCL), a RuntimeError naming the backend or its socket where it does not (gloo)."""
    dist_error = getattr(torch.distributed, "DistError", ())
    return isinstance(e, dist_error) or (isinstance(e, RuntimeError) and bool(_COLLECTIVE_FAILED.search(str(e))))


def ranks_lost(acc: Any, e: BaseException, latest_step: int | None, out: str) -> RanksLost:
    """The error of a rank whose collective failed, in place of torch's traceback (logged at DEBUG:
    -v shows it): a rank that stopped on its own error (a corrupt shard, a bad sample) printed that
    error; the others, left in the step's collective, printed a gloo or NCCL traceback that said
    neither why nor what next. Most often another rank went away; where no other rank says why,
    the cause may be this rank's own device (NCCL raises its local faults the same way)."""
    text = str(e).strip()
    said = text.splitlines()[0] if text else type(e).__name__
    said = re.sub(r"^\[[^\]]*\.(cc|cpp):\d+\]\s*", "", said).split(". ")[0][:200]  # less gloo's source position
    then = (f"the latest checkpoint in {out} is step {latest_step}: once the cause is fixed, the same command with "
            "--resume continues from there" + (f" ({RESUBMIT})" if os.environ.get("SLURM_JOB_ID") else "")) \
        if latest_step is not None else \
        f"{out} holds no checkpoint yet: once the cause is fixed, the same command starts again"
    return RanksLost(f"rank {acc.process_index} of {acc.num_processes}: a collective between the ranks failed "
                     f"({said}): most likely another rank stopped, and its own error, above, says why (killed, out "
                     "of memory, a bad shard; or it hung past the backend's timeout); where none does, look at this "
                     f"rank's device. {then}")
