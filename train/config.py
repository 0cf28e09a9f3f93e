"""The trainer's settings: one keyword-only dataclass, from a JSON config file and flags (flags win).
Each field is its own flag (`storage.flags`): its help and default are written once, here."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from layertap.storage.errors import ConfigError
from layertap.storage.flags import build, setting, settings
from layertap.storage.store import s3_options
from layertap.storage.units import parse_size


@dataclass(kw_only=True)
class TrainConfig:
    data: str = setting(help="the extraction's run prefix: s3://bucket/prefix or a local folder (required)")
    out: str = setting(help="checkpoints, metrics.jsonl and the exported drafter: s3://... or a folder (required)")
    model: str | None = setting(None, help="the target model folder the extraction used; only its embed_tokens "
                                           "and lm_head are read (default: the folder the run's manifest records)")
    gguf_file: str | None = setting(None, help="GGUF file inside --model")
    steps: int | None = setting(None, help="optimizer steps (default: --epochs passes over the data)")
    epochs: int = setting(1, help="passes over the data when --steps is not given")
    batch_size: int = setting(4, help="samples per micro-batch per rank")
    grad_accum: int = setting(1, help="micro-batches per optimizer step")
    lr: float = setting(6e-4, help="peak learning rate")
    min_lr_ratio: float = setting(0.1, help="the cosine schedule decays the learning rate to lr x this")
    warmup_ratio: float = setting(0.04, help="share of the steps that warm the learning rate up")
    weight_decay: float = setting(0.0, help="AdamW's weight decay")
    max_grad_norm: float = setting(1.0, help="gradients are clipped to this norm")
    seed: int = setting(0, help="the loader's shuffle and the anchors drawn per micro-batch; the drafter's "
                                "initial weights do not depend on it (always seeded with 0, drawn on the training device: a GPU "
                                "draws other numbers than a CPU)")
    save_every: int = setting(500, help="steps between checkpoints, and one at the end")
    keep_checkpoints: int = setting(2, help=(
        "newest checkpoints kept in --out (0: every one, for `eval --step` of each)"))
    log_every: int = setting(10, help="steps between logged metrics")
    num_workers: int = setting(0, help="DataLoader worker processes per rank")
    shuffle_buffer: int = setting(64, help="samples in the loader's shuffle buffer")
    memory_budget: int = setting(4 << 30, parse=parse_size, help="bytes of fetched shard data per rank, e.g. 4GiB")
    fetch_threads: int = setting(8, help="concurrent ranged GETs per rank, or per worker with --num-workers "
                                         "(default {default}; S3 serves one connection at ~90 MB/s)")
    drafter_layers: int | None = setting(None, help="drafter depth (default: one per ~12 target layers)")
    block_size: int = setting(16, help="tokens per drafted block, the anchor included")
    max_anchors: int = setting(512, help="blocks sampled per sequence")
    gamma: float = setting(7.0, help="decay of the loss weight along a block: exp(-(k-1)/gamma) at position k")
    mask_token_id: int | None = setting(None, help="the drafter's mask token (default: len(tokenizer), the first "
                                                   "id the tokenizer does not use; when that is outside the "
                                                   "embedding, an unused special token, else the drafter learns a "
                                                   "mask embedding, which `layertap export-drafter --to "
                                                   "speculators` refuses; an id from the vocabulary size up learns "
                                                   "one on purpose)")
    objective: Literal["ce", "kl", "ce+kl"] = setting(
        "ce", help="what each draft slot learns: ce, the data's next token; kl, the target's next-token "
                   "distribution (forward KL), computed through its frozen norm and head from the final-layer "
                   "state the run stored (`layertap extract --final-state prenorm`); ce+kl, the sum")
    distill_temperature: float = setting(1.0, help="with --objective kl or ce+kl: both distributions are "
                                                   "softened by this temperature (the KL is scaled by its square)")
    mixed_precision: Literal["auto", "no", "bf16"] = setting(
        "auto", help="the forward's precision (default {default}: bf16 autocast on GPU, fp32 on CPU)")
    follow: bool = setting(False, help="train while the run is extracted: start before or during `layertap extract` "
                                       "(even before its manifest exists); the first epoch takes shards as they are "
                                       "committed and ends once extraction is over. Its step count comes from the "
                                       "samples the manifest's plan stores (its rows less those it knows are skipped; "
                                       "--steps overrides); later epochs read the "
                                       "complete run as usual")
    follow_poll_s: float = setting(30.0, help="with --follow: the longest wait in seconds between looks for new "
                                              "commits (backoff from 0.5 s)")
    delete_consumed: bool = setting(False, help="with --follow and --epochs 1: after each checkpoint, record the "
                                                "shards every rank has consumed and delete their data "
                                                "(a restart resumes from that checkpoint and never needs them)")
    resume: bool = setting(False, help="continue from the latest checkpoint in --out (same batches, same loss "
                                       "curve)")
    log_dir: str = setting("layertap-logs", help="TensorBoard logs, when tensorboard is installed")
    s3: dict[str, Any] = setting(default_factory=dict, config_only=True, help="storage.s3.S3Options fields")

    def __post_init__(self) -> None:
        if self.steps is not None and self.steps < 1:
            raise ConfigError(f"--steps must be >= 1, got {self.steps}")
        for name in ("epochs", "batch_size", "grad_accum", "save_every", "log_every", "max_anchors", "fetch_threads",
                     "shuffle_buffer"):
            if int(getattr(self, name)) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.block_size < 2:  # the drafter's own check, worded for the flag
            raise ConfigError(f"--block-size must be >= 2 (the anchor and at least one drafted token), got "
                              f"{self.block_size}")
        if self.drafter_layers is not None and self.drafter_layers < 1:
            raise ConfigError(f"--drafter-layers must be >= 1, got {self.drafter_layers}")
        for name in ("num_workers", "keep_checkpoints"):  # 0: no DataLoader workers; keep every checkpoint
            if getattr(self, name) < 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if self.mask_token_id is not None and self.mask_token_id < 0:
            raise ConfigError(f"--mask-token-id must be >= 0, got {self.mask_token_id}")
        # NaN fails every comparison, so each float is checked to lie inside its range, and inf is out of it
        for name, need, why in (
                ("lr", "positive", "0 learns nothing, a negative rate climbs the loss"),
                ("max_grad_norm", "> 0", "gradients are clipped to this norm: 0 learns nothing"),
                ("weight_decay", ">= 0", "a negative decay grows the weights"),
                ("distill_temperature", "> 0", "both distributions are divided by it"),
                ("gamma", "> 0", "block position k weighs exp(-(k-1)/gamma)"),
                ("follow_poll_s", "> 0", "seconds between looks for new commits")):
            value = float(getattr(self, name))
            if not ((value >= 0 if need == ">= 0" else value > 0) and value < math.inf):
                raise ConfigError(f"--{name.replace('_', '-')} must be {need} and finite, got {value:g} ({why})")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"--min-lr-ratio must be within [0, 1], got {self.min_lr_ratio}")
        if not 0 <= self.warmup_ratio < 1:
            raise ConfigError(f"--warmup-ratio must be within [0, 1), got {self.warmup_ratio}")
        if self.objective not in ("ce", "kl", "ce+kl"):
            raise ConfigError(f"--objective must be ce, kl or ce+kl, not {self.objective!r}")
        if self.mixed_precision not in ("auto", "no", "bf16"):
            raise ConfigError(f"--mixed-precision must be auto, no or bf16, not {self.mixed_precision!r}")
        if self.delete_consumed and not (self.follow and self.epochs == 1):
            missing = [x for x, ok in (("--follow", self.follow), (f"--epochs 1 (got {self.epochs})", self.epochs == 1))
                       if not ok]
            raise ConfigError(f"--delete-consumed needs {' and '.join(missing)}: it deletes the data of shards "
                              "training has read for the last time")
        try:
            self.memory_budget = parse_size(self.memory_budget)
        except ValueError as e:
            raise ConfigError(f"--memory-budget: {e}") from None
        s3_options(self.s3)  # a misspelt setting is named now, even if every store is a local folder

    def identity(self) -> dict[str, Any]:
        """What a resumed run must share with the checkpoint it continues (order and objective)."""
        keys = ("data", "seed", "batch_size", "grad_accum", "epochs", "steps", "lr", "min_lr_ratio", "warmup_ratio",
                "weight_decay", "max_grad_norm", "block_size", "max_anchors", "gamma", "shuffle_buffer")
        ident = {k: getattr(self, k) for k in keys}
        ident["objective"] = self.objective  # a checkpoint without it was trained with ce (`RESUME_DEFAULTS`)
        if self.objective != "ce":
            ident["distill_temperature"] = self.distill_temperature
        if self.follow:  # only when set: checkpoints written before follow mode existed still compare equal
            ident["follow"] = True
        return ident


# What a checkpoint written before a setting existed trained with: compared as if it had recorded it.
RESUME_DEFAULTS: dict[str, Any] = {"objective": "ce"}


def load_train_config(args: Any) -> TrainConfig:
    """The settings of a parsed command line: its --config file, then its flags."""
    values = settings(TrainConfig, args)
    for required in ("data", "out"):
        if not values.get(required):
            raise ConfigError(f"missing --{required}: layertap train --data RUN_PREFIX --out PREFIX_OR_DIR "
                              "[--model TARGET]")
    return build(TrainConfig, values, args)
