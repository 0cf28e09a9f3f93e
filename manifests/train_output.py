"""What `layertap status` says of a `layertap train` output: steps, the last loss, the latest
checkpoint and whether the drafter was exported.

Read-only, and without torch: `manifests/` does not import `train/`, so the few key names the
trainer writes (train/trainer.py, train/checkpoint.py) are repeated here; tests/test_status_cli.py
checks them against the trainer's own. The listing of the checkpoints kept (`checkpoint_folders`,
`complete_checkpoints`) is here alone: train/checkpoint.py takes it from here.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from layertap.manifests.liveness import gone_from_here
from layertap.manifests.output_lease import Held, beat_progress, held_by
from layertap.manifests.output_lease import latest as latest_lease
from layertap.manifests.layout import MANIFEST
from layertap.storage.errors import ConfigError, InputError
from layertap.storage.store import ObjectNotFound, ObjectStore
from layertap.storage.units import listing

log = logging.getLogger(__name__)

METRICS = "metrics.jsonl"  # one JSON line per step, rewritten whole with each checkpoint
LATEST = "checkpoints/latest.json"  # {"step", "prefix"}: the checkpoint that counts
EXPORT_CONFIG = "drafter/config.json"  # written with the weights once training finished
# where the trainer ran as a job of `layertap submit train`, whose script passes --resume itself
RESUBMIT = "as a Slurm job of `layertap submit`: the same submit command, which passes --resume"
TAIL_BYTES = 64 << 10  # the last metrics line is in the file's last 64 KiB (a line is ~0.5 KiB)


def check_apart(out: ObjectStore, data: ObjectStore) -> None:
    """--out must be a prefix of its own: inside a run (or holding one), `layertap delete` of the
    one deletes the other, and `status` shows only the run. Asked by `layertap train` at its start,
    and by `submit` before a training job waits in the queue (behind a whole extraction)."""
    a, b = out.uri.rstrip("/") + "/", data.uri.rstrip("/") + "/"
    if a.startswith(b) or b.startswith(a):
        raise ConfigError(f"--out {out.uri} and --data {data.uri} overlap: `layertap delete` of one would delete the "
                          "other; give the training output a prefix of its own (e.g. beside the run)")
    if out.exists(MANIFEST):
        raise ConfigError(f"--out {out.uri} holds an extraction run (its {MANIFEST}); give the training output a "
                          "prefix of its own")


def training_status(store: ObjectStore) -> dict[str, Any] | None:
    """A JSON-ready summary of the training output at `store`, or None when it holds none."""
    latest = _json(store, LATEST)
    written = next((o.modified for o in store.list(LATEST)), None)
    if latest is None:  # as `layertap train` resumes it: from the newest complete checkpoint
        latest, written = _newest_complete(store)
    learned, after = _last_metrics(store)
    last = after[-1] if after else learned
    lease = latest_lease(store)  # alive, or stale alone: a trainer that stopped before its first checkpoint
    held = held_by(store, lease)  # a trainer at work, maybe before its first checkpoint
    if latest is None and last is None and lease is None:
        return None
    # killed outright (SIGKILL, the OOM killer) on this machine: its lease lives on until its TTL,
    # but `train --resume` here takes the output over at once (liveness.gone_from_here)
    exited = held is not None and gone_from_here(held.holder)
    state = _json(store, f"{latest['prefix']}/state.json") if latest and latest.get("prefix") else None
    config = (state or {}).get("config") or {}
    exported = store.exists(EXPORT_CONFIG)
    now = store.now() if written is not None or held is not None else None  # the store's clock stamped both
    return {
        "kind": "training",
        "prefix": store.uri,
        "data": config.get("data"),
        "step": last.get("step") if last else None,
        # the last step the run trains to, as its latest checkpoint recorded it (--epochs runs too); else --steps
        "steps_total": (state or {}).get("total_steps") if type((state or {}).get("total_steps")) is int
        else config.get("steps"),
        "epochs": config.get("epochs") if config.get("steps") is None else None,
        "epoch": last.get("epoch") if last else None,
        "loss": learned.get("loss") if learned else None,
        "loss_step": learned.get("step") if learned else None,
        # the steps after it with no loss: zero-weighted padding (no supervised slot), or diverged (NaN, inf)
        "steps_without_loss": {"padding": sum(padding_only(r) for r in after),
                               "not_finite": sum(not padding_only(r) for r in after)},
        "acc_first": (learned or last or {}).get("acc_first"),
        "tokens_per_s": last.get("tokens_per_s") if last else None,
        "checkpoint_step": latest.get("step") if latest else None,
        "checkpoint": f"{store.uri.rstrip('/')}/{latest['prefix']}" if latest and latest.get("prefix") else None,
        # named by latest.json (written after a checkpoint's files) without its state.json: a delete cut short
        "checkpoint_incomplete": bool(latest and latest.get("prefix")) and state is None,
        "checkpoint_age_s": round(max(0.0, now - written), 1) if written is not None else None,
        "drafter_exported": exported,
        "trainer": None if held is None or exited else {**_trainer(held, now), **_last_step(store, held, now)},
        "trainer_exited": _trainer(held, now) if exited else None,
        "complete": exported,
    }


def _trainer(held: Held, now: float) -> dict[str, Any]:
    return {"host": held.holder.get("host"), "pid": held.holder.get("pid"), "slurm_job": held.holder.get("slurm_job"),
            "lease_renewed_s_ago": round(max(0.0, now - held.modified), 1)}


def _last_step(store: ObjectStore, held: Held, now: float) -> dict[str, Any]:
    """The running trainer's last step and how long ago it ended, and whether it waits for extraction
    now, from its lease's last beat: its lease alone said "running" of ranks hung for good."""
    said = beat_progress(store, held)
    step, age = said.get("step"), said.get("step_age_s")
    if type(step) is not int or not isinstance(age, (int, float)) or isinstance(age, bool):
        return {}
    return {"last_step": step, "last_step_s_ago": round(max(0.0, age + now - held.modified), 1),
            "waiting_for_data": said.get("waiting_for_data") is True,
            "saving_checkpoint": said.get("saving_checkpoint") is True}


def step_prefix(step: int) -> str:
    return f"checkpoints/step-{step:08d}"


def checkpoint_folders(store: ObjectStore) -> dict[int, list[str]]:
    """The keys under each `checkpoints/step-N/` folder, by step. A folder named otherwise (a copy
    kept by hand, `step-00000100.bak`) is no checkpoint of this output: left alone, and said
    (it crashed every later save's pruning with int()'s ValueError, and eval --step)."""
    folders: dict[int, list[str]] = {}
    strangers: set[str] = set()
    for o in store.list("checkpoints/step-"):
        name = o.key.split("/")[1]
        if name.removeprefix("step-").isdigit():
            folders.setdefault(int(name.removeprefix("step-")), []).append(o.key)
        else:
            strangers.add(name)
    if strangers:
        log.warning("%s/checkpoints holds folder(s) that are no checkpoint of it, left alone: %s", store.uri,
                    listing(sorted(strangers), 5))
    return folders


def complete_checkpoints(store: ObjectStore) -> list[int]:
    """The steps of the checkpoints whose state.json exists (written after every other file)."""
    return sorted(s for s, keys in checkpoint_folders(store).items() if f"{step_prefix(s)}/state.json" in keys)


def _newest_complete(store: ObjectStore) -> tuple[dict[str, Any] | None, float | None]:
    """Where latest.json is missing (a first save stopped before it named its checkpoint, or the
    file deleted): the newest complete checkpoint, as latest.json would name it and as `train
    --resume` takes it, and when its state.json was written; (None, None) where there is none."""
    step = max(complete_checkpoints(store), default=None)
    if step is None:
        return None, None
    prefix = step_prefix(step)
    return {"step": step, "prefix": prefix}, next((o.modified for o in store.list(f"{prefix}/state.json")), None)


def _json(store: ObjectStore, key: str) -> dict[str, Any] | None:
    try:
        obj = json.loads(store.get(key))
    except ObjectNotFound:
        return None
    except (ValueError, RecursionError) as e:
        raise InputError(f"{store.uri.rstrip('/')}/{key} is corrupt (not JSON: {e})") from None
    return obj if isinstance(obj, dict) else None


def padding_only(record: dict[str, Any]) -> bool:
    """Whether a step's metrics record had no supervised slot (`acc_per_position` all None): zero
    loss weight, no loss, no update. Here, torch-free, for `status`; the trainer's closing line
    and progress bar use it too."""
    acc = record.get("acc_per_position")
    return isinstance(acc, list) and all(a is None for a in acc)


def _last_metrics(store: ObjectStore) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """The last complete line of metrics.jsonl with a loss, and the lines after that one (a step
    of zero-weighted padding alone has no loss, nor one whose loss was NaN or infinite, written
    null; `train`'s closing line tells them apart too), read from the file's tail (it grows with
    steps)."""
    try:
        size = store.size(METRICS)
        if not size:
            return None, []
        tail = bytes(store.get_range(METRICS, max(0, size - TAIL_BYTES), size))
    except ObjectNotFound:
        return None, []
    after = []
    for line in reversed(tail.decode(errors="replace").splitlines()):
        try:  # NaN as an earlier version wrote it: null, so `status --json` stays strict JSON
            record = json.loads(line, parse_constant=lambda constant: None)
        except ValueError:  # the first line of the tail may be cut
            continue
        if isinstance(record, dict) and "step" in record:
            if isinstance(record.get("loss"), (int, float)):
                return record, after[::-1]
            after.append(record)
    return None, after[::-1]
