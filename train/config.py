"""The trainer's settings: one keyword-only dataclass, from a JSON config file and flags (flags win)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from layertap.extract.config import read_config_file
from layertap.storage.units import parse_size


@dataclass(kw_only=True)
class TrainConfig:
    data: str  # the extraction's run prefix
    out: str  # checkpoints, metrics and the exported drafter: an S3 prefix or a local folder
    model: str | None = None  # the target model folder (only its embeddings and head are read);
    # None: the one the run's manifest records, when that folder exists on this machine
    gguf_file: str | None = None
    steps: int | None = None  # optimizer steps; None: `epochs` passes over the data
    epochs: int = 1
    batch_size: int = 4  # samples per micro-batch per rank
    grad_accum: int = 1
    lr: float = 6e-4
    min_lr_ratio: float = 0.1  # the cosine decays to lr * min_lr_ratio
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    seed: int = 0
    save_every: int = 500  # steps between checkpoints (and one at the end)
    keep_checkpoints: int = 2
    log_every: int = 10
    num_workers: int = 0  # DataLoader worker processes per rank
    shuffle_buffer: int = 64
    memory_budget: int = 4 << 30  # bytes of fetched shard data per rank
    fetch_threads: int = 8  # concurrent ranged GETs per rank (per DataLoader worker with num_workers)
    # The drafter; None takes the default sized from the target (train.drafter.default_config).
    drafter_layers: int | None = None
    block_size: int = 16
    max_anchors: int = 512
    gamma: float = 7.0
    mask_token_id: int | None = None  # None: len(tokenizer), the first id the tokenizer does not use
    mixed_precision: Literal["auto", "no", "bf16"] = "auto"  # auto: bf16 autocast on GPU, fp32 on CPU
    resume: bool = False
    log_dir: str = "layertap-logs"
    s3: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {self.steps}")
        for name in ("epochs", "batch_size", "grad_accum", "save_every", "log_every", "block_size", "max_anchors",
                     "fetch_threads"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.lr <= 0 or not 0 <= self.min_lr_ratio <= 1 or not 0 <= self.warmup_ratio < 1:
            raise ValueError("need lr > 0, 0 <= min_lr_ratio <= 1 and 0 <= warmup_ratio < 1")
        if self.mixed_precision not in ("auto", "no", "bf16"):
            raise ValueError(f"mixed_precision must be auto, no or bf16, not {self.mixed_precision!r}")
        self.memory_budget = parse_size(self.memory_budget)

    def identity(self) -> dict[str, Any]:
        """What a resumed run must share with the checkpoint it continues (order and objective)."""
        keys = ("data", "seed", "batch_size", "grad_accum", "epochs", "steps", "lr", "min_lr_ratio", "warmup_ratio",
                "weight_decay", "max_grad_norm", "block_size", "max_anchors", "gamma", "shuffle_buffer")
        return {k: getattr(self, k) for k in keys}


def load_train_config(path: str | None, overrides: dict[str, Any]) -> TrainConfig:
    """Settings from a JSON file, then the given command-line values on top."""
    values = read_config_file(path, TrainConfig)
    values.update({k: v for k, v in overrides.items() if v is not None})
    for required, flag in (("data", "--data"), ("out", "--out")):
        if not values.get(required):
            raise ValueError(f"missing {flag}: layertap train --data RUN_PREFIX --out PREFIX_OR_DIR [--model TARGET]")
    return TrainConfig(**values)
