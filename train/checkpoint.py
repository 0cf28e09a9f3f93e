"""Training checkpoints and the exported drafter, on any store (S3 prefix or local folder).

A checkpoint is the objects under ``checkpoints/step-NNNNNNNN/``: ``drafter.safetensors``
(the trainable weights; the target's borrowed embeddings are not copied), ``optimizer.safetensors``
(AdamW's moments and step per weight, plus the torch RNG state), ``state.json`` (step, the
drafter and training config, the folder of this save's loader positions) and
``loader/{draw}/rank-RRRRR.json``, each rank's loader position, written by that rank: in the
follow epoch a position lists every shard each of its consumers took (~1.5 MB a rank at 36,000
shards), which gathered to rank 0 made every rank's GPU receive, and state.json hold, all of them
(~1.5 GB at 1,000 ranks). `{draw}`, rank 0's random draw per save, keeps two saves of one step
apart (a trainer taken over that went on; a save killed half-way and redone). It counts only once
``checkpoints/latest.json`` names it, and that pointer is written last, so a run killed while
saving resumes from the previous checkpoint. No pickle: safetensors and JSON only. state.json
records each safetensors file's xxh3-64, checked as it is loaded: a ranged read carries no
checksum of the store's, and a flipped bit in the moments would resume silently wrong.

The safetensors files are streamed into the store's writer one tensor at a time
(`write_safetensors`), not built in memory first: at a 27B target's shapes a checkpoint holds
~22 GB (weights and AdamW moments), which the library's `save()` would copy into one `bytes`
object before the upload could start.

The exported drafter is ``drafter/model.safetensors`` + ``drafter/config.json``
(docs/TRAINING.md describes the layout).
"""

from __future__ import annotations

import json
import logging
import reprlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from layertap.manifests import layout
from layertap.manifests.train_output import checkpoint_folders, complete_checkpoints, step_prefix
from layertap.storage.errors import InputError, MissingInput
from layertap.storage.records import safetensors_header, safetensors_layout
from layertap.storage.store import ObjectNotFound, ObjectStore
from layertap.storage.units import listing
from layertap.train.drafter import DFlashDrafter, DrafterConfig

log = logging.getLogger(__name__)

STATE_FORMAT = "layertap-train-state"
STATE_VERSION = 1
LATEST = "checkpoints/latest.json"
WEIGHTS_XXH3 = "weights_xxh3"  # in an export's config.json: its model.safetensors' xxh3-64
EXPORT_WEIGHTS, EXPORT_CONFIG = "drafter/model.safetensors", "drafter/config.json"


def loader_key(step: int, folder: str, rank: int) -> str:
    return f"{step_prefix(step)}/{folder}/rank-{rank:05d}.json"


def save_loader_state(store: ObjectStore, step: int, folder: str, rank: int, state: Mapping[str, Any]) -> None:
    """Rank `rank`'s loader position in the checkpoint of `step`, by that rank, in this save's
    `folder` (compact JSON: its lists of shard ids are most of it). The checkpoint's state.json,
    naming the folder, comes after every rank's."""
    store.put(loader_key(step, folder, rank), json.dumps(state, separators=(",", ":")).encode())


def load_loader_state(store: ObjectStore, ckpt: Checkpoint, rank: int) -> dict[str, Any]:
    """Rank `rank`'s loader position in `ckpt`: its own file in the folder state.json names, or,
    in a checkpoint written before those, its entry in state.json's `loader` list."""
    if "loader" in ckpt.state:
        return ckpt.state["loader"][rank]
    fix = Advice(lambda: earlier_checkpoint_advice(store, ckpt.step))
    if not isinstance(ckpt.state.get("loader_states"), str):
        raise InputError(f"{store.uri}/{step_prefix(ckpt.step)}/state.json names no loader positions; {fix}")
    key = loader_key(ckpt.step, ckpt.state["loader_states"], rank)
    try:
        state = json.loads(store.get(key))
        if not isinstance(state, dict) or state.get("rank", rank) != rank:
            raise ValueError(f"it holds rank {state.get('rank')}'s loader position, not rank {rank}'s"
                             if isinstance(state, dict) else "it is not a loader position")
        return state
    except ObjectNotFound:
        raise InputError(f"checkpoint {store.uri}/{step_prefix(ckpt.step)} lacks rank {rank}'s loader position "
                         f"({key}): the checkpoint is incomplete; {fix}") from None
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, JSON nested too deep
        raise InputError(f"{store.uri}/{key} is corrupt ({e}); {fix}") from None


@dataclass
class Checkpoint:
    step: int
    state: dict[str, Any]  # state.json
    weights: dict[str, torch.Tensor]
    optimizer: dict[str, torch.Tensor]


@dataclass
class Snapshot:
    """What a checkpoint saves: the live drafter and optimizer (read tensor by tensor while
    writing) and the JSON state the trainer adds (config, world size, loader positions)."""

    step: int
    model: DFlashDrafter
    optimizer: torch.optim.Optimizer
    state: dict[str, Any]


def save_checkpoint(store: ObjectStore, snap: Snapshot, keep: int, check: Callable[[], None] = lambda: None) -> str:
    """Write a checkpoint, point `latest.json` at it, then drop all but it and the `keep - 1` newest
    complete ones before it (`_prune`). `check` raises to stop before `latest.json` moves: the
    output taken over by another trainer while the files were written (minutes at a large drafter)."""
    prefix = step_prefix(snap.step)
    trainable = snap.model.trainable_state()
    names = {id(p): n for n, p in trainable.items()}
    params = [p for g in snap.optimizer.param_groups for p in g["params"]]
    moments: dict[str, torch.Tensor] = {"rng.torch": torch.get_rng_state()}
    opt = snap.optimizer.state_dict()  # references to the live moments, not copies
    for i, p in enumerate(params):
        for key, value in opt["state"].get(i, {}).items():
            moments[f"{names[id(p)]}.{key}"] = torch.as_tensor(value)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt["param_groups"]]
    files = {name: {"xxh3": write_safetensors(store, f"{prefix}/{name}", tensors)}
             for name, tensors in (("drafter.safetensors", trainable), ("optimizer.safetensors", moments))}
    full = {"format": STATE_FORMAT, "version": STATE_VERSION, "step": snap.step, "param_groups": groups,
            "drafter": snap.model.config.to_json(), "files": files, **snap.state}
    store.put(f"{prefix}/state.json", json.dumps(full, indent=1).encode())
    check()
    store.put(LATEST, json.dumps({"step": snap.step, "prefix": prefix}).encode())
    _prune(store, keep, snap.step)
    return prefix


_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL"}


def write_safetensors(store: ObjectStore, key: str, tensors: Mapping[str, torch.Tensor],
                      metadata: Mapping[str, str] | None = None, dtype: torch.dtype | None = None) -> str:
    """A safetensors file streamed into the store's writer, one tensor at a time.

    The header (u64 length, JSON padded with spaces to 8 bytes) needs only shapes and dtypes, so it
    goes first; then each tensor is copied to the host (a no-op for a contiguous CPU tensor) and
    written as its own bytes. Host memory stays at one tensor plus the writer's buffers, and the
    upload runs while later tensors are still on the GPU. Tensors are cast to `dtype` when given.
    The object appears only once complete (the writer publishes on close, discards on error).
    Returns the file's xxh3-64 (hex), for `load_safetensors` to check.
    """
    layout = {name: (_ST_DTYPES[dtype or t.dtype], list(t.shape), t.numel() * (dtype or t.dtype).itemsize)
              for name, t in tensors.items()}
    digest = xxhash.xxh3_64()
    with store.open_writer(key) as w:
        header = safetensors_header(layout, metadata or None)
        digest.update(header)
        w.write(header)
        for t in tensors.values():
            host = t.detach().to("cpu", dtype or t.dtype).contiguous()
            if host.numel():
                data = host.reshape(-1).view(torch.uint8).numpy().data
                digest.update(data)
                w.write(data)
    return digest.hexdigest()


_ST_TORCH = {name: dtype for dtype, name in _ST_DTYPES.items()}
_ST_ITEMSIZE = {name: dtype.itemsize for dtype, name in _ST_DTYPES.items()}
_ST_MAX_HEADER = 100 << 20  # the safetensors library's own limit


def _then(fix: str | Advice) -> str:
    """'; what to do', after any way a file can be damaged (an `Advice` is worded only then: it lists)."""
    return f"; {fix}" if fix else ""


def load_safetensors(store: ObjectStore, key: str, data: bool = True, xxh3: str | None = None,
                     fix: str | Advice = "") -> dict[str, torch.Tensor]:
    """A safetensors file read tensor by tensor into tensors of its own: host memory holds the
    tensors once, not the file's bytes beside them (`load(store.get(key))` holds both: 2x a 27B
    run's ~22 GB of weights and moments on resume). One ranged read per tensor, straight into it;
    the header is checked as the shard records' is (`storage.records.safetensors_layout`).
    Without `data`, only the header is read: the tensors come uninitialized, for a rank that
    receives their values from rank 0 (`ranks.broadcast_tensors`). With `xxh3` (what
    `write_safetensors` returned), the bytes read are checked against it (`fix`: what the error
    advises when they differ)."""
    size = store.size(key)
    head = store.get_range(key, 0, 8)
    n = int.from_bytes(head, "little") if len(head) == 8 else -1
    if not 0 < n <= min(_ST_MAX_HEADER, size - 8):
        raise InputError(f"{store.uri}/{key} is not a safetensors file (header length {n}, file {size} B){_then(fix)}")
    header = store.get_range(key, 8, 8 + n)
    try:
        _, layout = safetensors_layout(header, size - 8 - n, _ST_ITEMSIZE)
    except (ValueError, UnicodeDecodeError) as e:  # json's errors are ValueErrors
        raise InputError(f"{store.uri}/{key} is corrupt or cut short: {e}{_then(fix)}") from None
    digest = xxhash.xxh3_64(head)
    digest.update(header)
    out: dict[str, torch.Tensor] = {}
    for name, (dtype, shape, begin, end) in sorted(layout.items(), key=lambda item: item[1][2]):  # file order
        t = torch.empty(shape, dtype=_ST_TORCH[dtype])
        if data and end > begin:
            view = memoryview(t.view(-1).view(torch.uint8).numpy())
            if store.read_range_into(key, 8 + n + begin, view) != end - begin:
                raise InputError(f"{store.uri}/{key} ends inside tensor {name}: the file is cut short{_then(fix)}")
            digest.update(view)
        out[name] = t
    if data and xxh3 is not None and digest.hexdigest() != xxh3:
        raise InputError(f"{store.uri}/{key} is corrupt: its bytes hash to xxh3 {digest.hexdigest()}, not the "
                         f"{xxh3} recorded when it was saved{_then(fix)}")
    return out


def _prune(store: ObjectStore, keep: int, latest: int) -> None:
    """Keep checkpoint `latest` (the one `latest.json` names) and the `keep - 1` newest complete
    ones before it.

    A save killed mid-upload leaves a folder without state.json (written after the weights),
    possibly at a step above the latest: a resumed run saves lower steps than it. Such folders
    are deleted, and only complete checkpoints count, so pruning never removes the one a resume
    needs in favour of a partial one."""
    if keep < 1:
        return
    folders = checkpoint_folders(store)
    complete = [s for s, keys in folders.items() if s < latest and f"{step_prefix(s)}/state.json" in keys]
    kept = {latest, *sorted(complete, reverse=True)[:keep - 1]}
    for step, keys in folders.items():
        if step not in kept:
            # state.json first: a prune cut short leaves no folder that looks complete without its files
            state = f"{step_prefix(step)}/state.json"
            store.delete_many(sorted(keys, key=lambda k: k != state))  # a loader position a rank: 1,000s of keys
            store.remove_empty_folders(f"{step_prefix(step)}/")  # a local --out kept step-N/loader/ empty


def _json(store: ObjectStore, key: str, fix: str | Advice) -> dict[str, Any]:
    """The JSON object at `key`; an `InputError` naming it (and `fix`) where it is not one."""
    try:
        value = json.loads(store.get(key))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise InputError(f"{store.uri.rstrip('/')}/{key} is corrupt ({e}); {fix}") from None
    if not isinstance(value, dict):
        raise InputError(f"{store.uri.rstrip('/')}/{key} is not a JSON object; {fix}")
    return value


def _recorded_xxh3(state: Mapping[str, Any], name: str) -> str | None:
    """The xxh3 a checkpoint's state.json records for its file `name` (None before they did)."""
    entry = (state.get("files") or {}).get(name)
    return entry.get("xxh3") if isinstance(entry, dict) else None


def load_latest(store: ObjectStore, tensors: bool = True) -> Checkpoint | None:
    """The checkpoint `latest.json` names, or None when the output has none. Without `tensors`,
    the weights and moments come uninitialized (their headers read, not their ~22 GB at a 27B
    target's shapes): a rank other than 0 receives them from rank 0."""
    try:
        latest = _json(store, LATEST, Advice(lambda: f"rewrite it to name a complete checkpoint ({{\"step\": N, "
                                             f"\"prefix\": \"{step_prefix(0)[:-8]}<N, 8 digits>\"}}; {_kept(store)}), "
                                             "or delete it to resume from the newest complete one"))
    except ObjectNotFound:
        # Absent, with checkpoints beside it: a first save stopped before it named its checkpoint, or
        # the file deleted (as its damage's message once advised). Taken for no checkpoint, the output
        # was trained from step 0 and the first save's pruning deleted every checkpoint there.
        newest = max(complete_checkpoints(store), default=None)
        if newest is None:
            return None
        log.warning("%s has no %s but holds complete checkpoints: taking the newest, step %d", store.uri, LATEST,
                    newest)
        latest = {"step": newest, "prefix": step_prefix(newest)}
    prefix = latest.get("prefix")
    if not isinstance(prefix, str):
        raise InputError(f"{store.uri.rstrip('/')}/{LATEST} names no checkpoint (no \"prefix\"); rewrite it to "
                         f"name one ({_kept(store)}), or delete it to resume from the newest complete one")
    damaged = Advice(lambda: earlier_checkpoint_advice(store, latest.get("step")))
    try:
        state = _json(store, f"{prefix}/state.json", damaged)
        if state.get("format") != STATE_FORMAT or state.get("version") != STATE_VERSION:
            raise InputError(f"{store.uri}/{prefix}/state.json is not a layertap v{STATE_VERSION} training state")
        if problem := _state_problem(state):
            raise InputError(f"{store.uri}/{prefix}/state.json is corrupt ({problem}); {damaged}")
        weights, optimizer = (load_safetensors(store, f"{prefix}/{name}", tensors, _recorded_xxh3(state, name), damaged)
                              for name in ("drafter.safetensors", "optimizer.safetensors"))
    except ObjectNotFound as e:
        raise InputError(f"checkpoint {store.uri}/{prefix} named by {LATEST} is incomplete: {e}; {damaged}") from None
    return Checkpoint(state["step"], state, weights, optimizer)


def _kept(store: ObjectStore) -> str:
    steps = complete_checkpoints(store)
    return f"kept: steps {listing(steps, 8)}" if steps else "none is kept under checkpoints/"


class Advice:
    """What to do about a damaged checkpoint, worded only when an error is raised with it: it lists
    the checkpoints kept (a LIST of checkpoints/, loader positions and all), and worded up front,
    every rank's healthy resume listed them three times."""

    def __init__(self, words: Callable[[], str]):
        self._words = words

    def __str__(self) -> str:
        return self._words()

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)


def earlier_checkpoint_advice(store: ObjectStore, step: Any) -> str:
    """What to do about a damaged checkpoint: name an earlier complete one in latest.json."""
    earlier = [s for s in complete_checkpoints(store) if type(step) is not int or s < step]
    where = f"earlier ones kept: steps {listing(earlier, 8)}" if earlier else "no earlier one is kept"
    return (f"point {LATEST} at an earlier checkpoint ({{\"step\": N, \"prefix\": \"{step_prefix(0)[:-8]}<N, 8 "
            f"digits>\"}}; {where}), or train into another --out (a --delete-consumed trainer deleted the data "
            "trained on after its own latest checkpoint: an earlier one may need shards that are gone)")


_STATE_FIELDS = {"step": lambda v: type(v) is int and v >= 0, "drafter": lambda v: type(v) is dict,
                 "param_groups": lambda v: type(v) is list and all(type(g) is dict for g in v),
                 "files": lambda v: type(v) is dict and all(type(e) is dict and type(e.get("xxh3")) is str
                                                            for e in v.values()),
                 "config": lambda v: type(v) is dict, "world_size": lambda v: type(v) is int and v >= 1}


def _state_problem(state: Mapping[str, Any]) -> str | None:
    """What is wrong with a state.json's fields (a resume crashed on each with a KeyError, TypeError
    or AttributeError; a `files` entry of another shape switched its xxh3 check off); None if sound.
    `files`, `config` and `world_size` may be absent (a checkpoint from before they were recorded)."""
    for name, fits in _STATE_FIELDS.items():
        if name not in state:
            if name in ("step", "drafter", "param_groups"):
                return f"no {name}"
        elif not fits(state[name]):
            return f"its {name} is {reprlib.repr(state[name])}"
    return None


OPTIMIZER_IMPLEMENTATION = ("fused", "foreach", "capturable", "differentiable")  # how it steps, not what


def restore(ckpt: Checkpoint, model: DFlashDrafter, optimizer: torch.optim.Optimizer) -> None:
    """Load weights, optimizer moments and RNG state saved by `save_checkpoint`."""
    model.load_trainable(ckpt.weights, "the checkpoint")
    trainable = model.trainable_state()
    names = {id(p): n for n, p in trainable.items()}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    by_name: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in ckpt.optimizer.items():  # "<weight name>.<moment>", e.g. "fc.weight.exp_avg"
        name, field = key.rsplit(".", 1)
        by_name.setdefault(name, {})[field] = t
    state: dict[int, dict[str, torch.Tensor]] = {}
    for i, p in enumerate(params):
        entry = by_name.get(names[id(p)])
        if entry:
            state[i] = {k: (v if k == "step" else v.to(p.device)) for k, v in entry.items()}
    groups = ckpt.state["param_groups"]
    current = optimizer.state_dict()["param_groups"]
    if len(groups) != len(current):
        raise InputError("the checkpoint's optimizer has a different number of parameter groups")
    # the saved hyperparameters, this process's implementation: a run resumed on another device
    # kind keeps its own (a CPU run's fused=False on a GPU would take the foreach path, whose
    # temporaries are the size of all weights: 6.8 GiB at a 27B target's drafter)
    optimizer.load_state_dict({"state": state, "param_groups": [
        {**g, **{k: c[k] for k in OPTIMIZER_IMPLEMENTATION if k in c}, "params": c["params"]}
        for g, c in zip(groups, current)]})
    torch.set_rng_state(ckpt.optimizer["rng.torch"])


def export_drafter(store: ObjectStore, model: DFlashDrafter) -> None:
    """The trained drafter: its weights and config.json (which names the target it drafts for, and
    the weights' xxh3: read by ranged GETs, which carry no checksum, a flipped byte was exported on)."""
    digest = write_safetensors(store, EXPORT_WEIGHTS, model.trainable_state(), {"format": "layertap-dflash-drafter"},
                               dtype=torch.float32)
    store.put(EXPORT_CONFIG, json.dumps({**model.config.to_json(), WEIGHTS_XXH3: digest}, indent=1).encode())


def withdraw_export(store: ObjectStore) -> bool:
    """Delete the drafter exported at an earlier end of this output, before training it further:
    left there, `status` called the output complete and `export-drafter` and `eval` took the old
    weights over newer checkpoints, if the longer run stopped before its own export. The config,
    the export's last file written, goes first. Whether there was one."""
    if not store.exists(EXPORT_CONFIG):
        return False
    store.delete(EXPORT_CONFIG)
    store.delete(EXPORT_WEIGHTS)
    return True


def load_drafter_files(store: ObjectStore, step: int | None = None) -> tuple[DrafterConfig, dict[str, torch.Tensor]]:
    """Config and weights of an exported drafter (a folder or prefix holding `drafter/` or the files),
    or, with `step`, of the drafter in that checkpoint (a learning curve evaluates several)."""
    if step is not None:
        prefix = step_prefix(step)
        try:
            state = _json(store, f"{prefix}/state.json", "evaluate another step (--step)")
            if not isinstance(state.get("drafter"), dict):
                raise InputError(f"{store.uri.rstrip('/')}/{prefix}/state.json records no drafter: not a layertap "
                                 "training state")
            return DrafterConfig.from_json(state["drafter"]), load_safetensors(
                store, f"{prefix}/drafter.safetensors", xxh3=_recorded_xxh3(state, "drafter.safetensors"),
                fix="evaluate another step (--step)")
        except ObjectNotFound:
            kept = complete_checkpoints(store)
            raise MissingInput(f"no checkpoint of step {step} at {store.uri} (kept: {kept or 'none'}; "
                               f"--keep-checkpoints sets how many are kept, 0 every one)") from None
    for base in ("drafter/", ""):
        try:
            config = _json(store, base + "config.json", "export the drafter again")
            recorded = config.get(WEIGHTS_XXH3)  # an export of an earlier layertap records none
            weights = load_safetensors(store, base + "model.safetensors", xxh3=recorded if type(recorded) is str else None,
                                       fix="delete the export (drafter/) and run the same `layertap train` with "
                                           "--resume, which exports its latest checkpoint again")
            return DrafterConfig.from_json(config), weights
        except ObjectNotFound:
            continue
    kept = complete_checkpoints(store)  # a training stopped before its export: its checkpoints are there
    if kept:
        raise MissingInput(f"no exported drafter at {store.uri}: its training has not finished (checkpoints kept: "
                           f"steps {listing(kept, 8)}); evaluate a checkpoint with --step {kept[-1]}, or finish the "
                           "training (the same `layertap train` with --resume), which exports it")
    if store.exists(layout.MANIFEST):
        raise MissingInput(f"no drafter at {store.uri}: it is an extraction's run; give --drafter the --out of a "
                           "`layertap train` on it")
    raise MissingInput(f"no drafter at {store.uri}: expected config.json and model.safetensors "
                       f"(or drafter/ holding them), as `layertap train` exports")
