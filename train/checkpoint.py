"""Training checkpoints and the exported drafter, on any store (S3 prefix or local folder).

A checkpoint is three objects under ``checkpoints/step-NNNNNNNN/``: ``drafter.safetensors``
(the trainable weights; the target's borrowed embeddings are not copied), ``optimizer.safetensors``
(AdamW's moments and step per weight, plus the torch RNG state) and ``state.json`` (step, the
drafter and training config, every rank's loader position). It counts only once
``checkpoints/latest.json`` names it, and that pointer is written last, so a run killed while
saving resumes from the previous checkpoint. No pickle: safetensors and JSON only.

The exported drafter is ``drafter/model.safetensors`` + ``drafter/config.json``
(docs/TRAINING.md describes the layout).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from layertap.storage.store import ObjectNotFound, ObjectStore
from layertap.train.drafter import DFlashDrafter, DrafterConfig

log = logging.getLogger(__name__)

STATE_FORMAT = "layertap-train-state"
STATE_VERSION = 1
LATEST = "checkpoints/latest.json"
EXPORT_WEIGHTS, EXPORT_CONFIG = "drafter/model.safetensors", "drafter/config.json"


def step_prefix(step: int) -> str:
    return f"checkpoints/step-{step:08d}"


@dataclass
class Checkpoint:
    step: int
    state: dict[str, Any]  # state.json
    weights: dict[str, torch.Tensor]
    optimizer: dict[str, torch.Tensor]


def save_checkpoint(store: ObjectStore, step: int, model: DFlashDrafter, optimizer: torch.optim.Optimizer,
                    state: dict[str, Any], keep: int) -> str:
    """Write a checkpoint, point `latest.json` at it, then drop all but the newest `keep`."""
    prefix = step_prefix(step)
    trainable = model.trainable_state()
    names = {id(p): n for n, p in trainable.items()}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    tensors: dict[str, torch.Tensor] = {"rng.torch": torch.get_rng_state()}
    opt = optimizer.state_dict()
    for i, p in enumerate(params):
        for key, value in opt["state"].get(i, {}).items():
            tensors[f"{names[id(p)]}.{key}"] = torch.as_tensor(value).detach().cpu().contiguous()
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt["param_groups"]]
    weights = {k: v.detach().cpu().contiguous() for k, v in trainable.items()}
    store.put(f"{prefix}/drafter.safetensors", st_save(weights))
    store.put(f"{prefix}/optimizer.safetensors", st_save(tensors))
    full = {"format": STATE_FORMAT, "version": STATE_VERSION, "step": step, "param_groups": groups,
            "drafter": model.config.to_json(), **state}
    store.put(f"{prefix}/state.json", json.dumps(full, indent=1).encode())
    store.put(LATEST, json.dumps({"step": step, "prefix": prefix}).encode())
    _prune(store, keep)
    return prefix


def _prune(store: ObjectStore, keep: int) -> None:
    steps = sorted({int(o.key.split("/")[1].removeprefix("step-")) for o in store.list("checkpoints/step-")})
    for old in steps[:-keep] if keep > 0 else []:
        for o in list(store.list(step_prefix(old) + "/")):
            store.delete(o.key)


def load_latest(store: ObjectStore) -> Checkpoint | None:
    """The checkpoint `latest.json` names, or None when the output has none."""
    try:
        latest = json.loads(store.get(LATEST))
    except ObjectNotFound:
        return None
    except json.JSONDecodeError as e:
        raise ValueError(f"{store.uri}/{LATEST} is corrupt ({e}); delete it to resume from scratch") from None
    prefix = latest["prefix"]
    try:
        state = json.loads(store.get(f"{prefix}/state.json"))
        weights = st_load(store.get(f"{prefix}/drafter.safetensors"))
        optimizer = st_load(store.get(f"{prefix}/optimizer.safetensors"))
    except ObjectNotFound as e:
        raise ValueError(f"checkpoint {store.uri}/{prefix} named by {LATEST} is incomplete: {e}") from None
    if state.get("format") != STATE_FORMAT or state.get("version") != STATE_VERSION:
        raise ValueError(f"{store.uri}/{prefix}/state.json is not a layertap v{STATE_VERSION} training state")
    return Checkpoint(int(state["step"]), state, weights, optimizer)


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
        raise ValueError("the checkpoint's optimizer has a different number of parameter groups")
    optimizer.load_state_dict({"state": state, "param_groups": [{**g, "params": c["params"]}
                                                                for g, c in zip(groups, current)]})
    torch.set_rng_state(ckpt.optimizer["rng.torch"])


def export_drafter(store: ObjectStore, model: DFlashDrafter) -> None:
    """The trained drafter: its weights and config.json (which names the target it drafts for)."""
    weights = {k: v.detach().cpu().float().contiguous() for k, v in model.trainable_state().items()}
    store.put(EXPORT_WEIGHTS, st_save(weights, metadata={"format": "layertap-dflash-drafter"}))
    store.put(EXPORT_CONFIG, json.dumps(model.config.to_json(), indent=1).encode())


def load_drafter_files(store: ObjectStore) -> tuple[DrafterConfig, dict[str, torch.Tensor]]:
    """Config and weights of an exported drafter (a folder or prefix holding `drafter/` or the files)."""
    for base in ("drafter/", ""):
        try:
            config = json.loads(store.get(base + "config.json"))
            weights = st_load(store.get(base + "model.safetensors"))
            return DrafterConfig.from_json(config), weights
        except ObjectNotFound:
            continue
    raise FileNotFoundError(f"no drafter at {store.uri}: expected config.json and model.safetensors "
                            f"(or drafter/ holding them), as `layertap train` exports")
