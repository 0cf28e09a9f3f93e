"""`layertap train`: a DFlash drafter trained on a run prefix, through accelerate.

Every rank streams its own share of the run (`train.ShardStream`, partitioned by rank) and
holds a full drafter replica (DDP; gloo on CPU, NCCL on GPU). The order of everything that
varies is fixed by (seed, step): the loader's shuffle, and the anchors drawn per micro-batch
from a generator seeded with (seed, step, micro-batch, rank). A checkpoint stores the step,
weights, AdamW moments, RNG and every rank's loader position, so `--resume` continues with the
same batches and the same loss curve as a run that never stopped. The learning rate is a pure
function of the step (linear warmup, cosine decay), so it needs no saved state.

Rank 0 holds a lease on --out (`manifests.output_lease`) from its start to its end: a second
trainer started on the same output is refused, not let to overwrite this one's checkpoints.

SIGTERM or SIGUSR1 (Slurm's preemption and time-limit warnings) make every rank stop at the
next step boundary; rank 0 saves a checkpoint and the job exits with 143 for a requeue. Ctrl-C
does the same and exits with 130 (a second one stops at once, without the checkpoint).
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import xxhash

from layertap.manifests.consumption import prefetch_depth
from layertap.manifests.manifest import Manifest, NoRun, load_manifest
from layertap.manifests.output_lease import OutputLease, taken_over
from layertap.manifests.preemption import Preempted, StopSignals
from layertap.manifests.train_output import RESUBMIT, check_apart, padding_only
from layertap.storage.errors import ConfigError, InputError, UserError
from layertap.storage.identity import RunConfig
from layertap.storage.store import ObjectStore, StoreError, open_configured_store, open_store
from layertap.storage.units import id_ranges, listing
from layertap.train.batch import collate
from layertap.train.checkpoint import (EXPORT_CONFIG, Snapshot, export_drafter, load_latest,
                                       load_loader_state, restore, save_checkpoint, save_loader_state, step_prefix,
                                       withdraw_export)
from layertap.train.config import RESUME_DEFAULTS, TrainConfig
from layertap.train.drafter import DFlashDrafter, DrafterConfig, default_config, num_parameters
from layertap.train.follow import wait_for_manifest
from layertap.train.loader import Prefetcher, StreamLoader
from layertap.train.objective import Distill, dflash_loss
from layertap.train.ranks import (agree_on_checkpoint, broadcast_tensors, collective_failed, from_rank_0, host_group,
                                  per_rank, raise_if_any_refused, ranks_lost)
from layertap.train.stream import ShardsChanged, ShardStream, StreamConfig
from layertap.train.target_head import head_transform, load_final_norm, load_target_head, recorded_target

log = logging.getLogger(__name__)

METRICS = "metrics.jsonl"
NONFINITE_LIMIT = 5  # steps in a row with a NaN or infinite loss or gradient before training stops
STALL_CHECK_S = 5.0  # follow mode: seconds of waiting for data between looks for a stalled window


def lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    """Linear warmup over `warmup_ratio` of the steps to `lr` at step `warm`, then cosine decay to
    `lr * min_lr_ratio` at the last step. (The ramp ended a step early, so the peak ran twice and a
    one-step warmup, any run of 25 to 49 steps, started at the full lr; the last step stayed above
    the floor.)"""
    warm = int(total * cfg.warmup_ratio)
    if step < warm:
        return cfg.lr * (step + 1) / (warm + 1)
    progress = min(1.0, (step - warm) / max(1, total - 1 - warm))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def anchor_generator(seed: int, step: int, micro: int, rank: int) -> torch.Generator:
    key = xxhash.xxh64_intdigest(f"{seed}/{step}/{micro}/{rank}".encode()) & ((1 << 63) - 1)
    return torch.Generator().manual_seed(key)


def mask_token_id(model: str, gguf_file: str | None, vocab_size: int) -> int:
    """len(tokenizer): the first id no text maps to (DFlash's mask token).

    A folder without tokenizer files loads as an empty tokenizer of length 1 (transformers does
    not fail), which would make a real token, id 1, the mask: refused instead. When that id is
    past the embedding (a tokenizer that fills it, like SmolLM2's), the mask is an unused special
    token inside the vocabulary: a drafter vLLM can serve (`export-drafter --to speculators` holds
    no mask embedding of its own). Without one, the drafter learns a mask embedding, which that
    export refuses: warned of here, before hours of training."""
    from transformers import AutoTokenizer

    from layertap.extract.embedded import checkpoint

    folder, gguf_file = checkpoint(model, gguf_file)  # the embedded SmolLM2: its converted folder
    tok = AutoTokenizer.from_pretrained(folder, **({"gguf_file": gguf_file} if gguf_file else {}))
    if len(tok) < 2:
        raise InputError(f"the target {model!r} has no usable tokenizer (it loads as an empty tokenizer of "
                         f"{len(tok)} token(s)), so the mask token id cannot be chosen from it: add the tokenizer "
                         "files to the folder, or pass --mask-token-id ID (a reserved or unused token id; below the "
                         "vocabulary size so that `layertap export-drafter --to speculators` can export the drafter)")
    if len(tok) < vocab_size:
        return len(tok)
    spare = spare_special_token(tok, vocab_size)
    if spare is not None:
        log.info("the tokenizer fills the target's %d-id vocabulary, so the drafter's mask token is its unused special "
                 "token %r (id %d); --mask-token-id %d would learn a mask embedding instead, which "
                 "`layertap export-drafter --to speculators` (the form vLLM serves) cannot hold", vocab_size, spare[1],
                 spare[0], vocab_size)
        return spare[0]
    log.warning("the mask token id %d (len(tokenizer)) is outside the target's vocabulary of %d ids and the tokenizer "
                "has no unused special token: the drafter learns a mask embedding of its own, and `layertap "
                "export-drafter --to speculators` (the form vLLM serves) will refuse it. For an exportable drafter, "
                "pass --mask-token-id ID (an unused id below the vocabulary size)", len(tok), vocab_size)
    return len(tok)


def spare_special_token(tok: Any, vocab_size: int) -> tuple[int, str] | None:
    """(id, text) of the highest-numbered special token inside the vocabulary that has no role
    (not BOS, EOS, PAD, UNK, ...) and that the chat template never writes (SmolLM2: 16,
    '<empty_output>', of StarCoder's code markup), a suggestion for a mask token. None if none."""
    roles = set(tok.all_special_ids)
    template = tok.chat_template if isinstance(tok.chat_template, str) else ""
    spare = [(i, t.content) for i, t in tok.added_tokens_decoder.items()
             if t.special and i < vocab_size and i not in roles and t.content not in template]
    return max(spare) if spare else None


def build_drafter(cfg: TrainConfig, run: RunConfig, saved: dict[str, Any] | None,
                  device: torch.device | str | None = None, borrowed_dtype: torch.dtype = torch.float32,
                  dataset: dict[str, Any] | None = None) -> DFlashDrafter:
    """The drafter for this run's target; a resumed run takes the checkpoint's config as is, its
    target record completed with the facts a checkpoint from before they were recorded lacks.
    `dataset`: the run manifest's (the chat-template settings its chats were rendered with)."""
    head = load_target_head(cfg.model, cfg.gguf_file)
    if run.hidden_size is not None and run.hidden_size != head.hidden_size:
        raise InputError(f"{cfg.model} has hidden size {head.hidden_size}, but the run at {cfg.data} stored "
                         f"states of width {run.hidden_size}: train with the target the extraction used")
    check_same_target(cfg, run)
    if saved is not None:
        dconf = DrafterConfig.from_json(saved)
        dconf.target = {**drafter_target(run, dataset), **dconf.target}
    else:
        mask = (cfg.mask_token_id if cfg.mask_token_id is not None
                else mask_token_id(cfg.model, cfg.gguf_file, head.vocab_size))
        if cfg.mask_token_id is not None and mask >= head.vocab_size:  # as the chosen id's warning says
            log.warning("--mask-token-id %d is outside the target's vocabulary of %d ids: the drafter learns a mask "
                        "embedding of its own, and `layertap export-drafter --to speculators` (the form vLLM serves) "
                        "will refuse it. For an exportable drafter, pass an unused id below %d (or leave the flag "
                        "out: layertap then picks one where the tokenizer has one)", mask, head.vocab_size,
                        head.vocab_size)
        dconf = default_config(head, run.layers, mask, num_layers=cfg.drafter_layers,
                               block_size=cfg.block_size, max_anchors=cfg.max_anchors, gamma=cfg.gamma,
                               target=drafter_target(run, dataset))
    torch.manual_seed(0)  # initial weights: the same on every rank and every run (drawn on `device`)
    return DFlashDrafter(dconf, head, device, borrowed_dtype)


# What a run's manifest records of its target beyond the width, as (`extract.model.load_target`'s
# info key, what it is): runs extracted before a fact was recorded lack it, and are not checked on it.
TARGET_FACTS = {"model_config_sha256": ("model_config_sha256", "config.json sha256"),
                "tokenizer_sha256": ("tokenizer_sha256", "tokenizer sha256 (vocabulary and special tokens)"),
                "model_revision": ("revision", "revision")}


def prepare(acc: Any, model: DFlashDrafter, optimizer: torch.optim.Optimizer) -> tuple[Any, torch.optim.Optimizer]:
    """accelerate's preparation of the drafter (DDP on several ranks) and its optimizer, without the
    float32 cast accelerate puts on a mixed-precision model's outputs (with the autocast around its
    forward that `train_step` has already). Under bf16 the drafter's [B, A, block, H] output then
    stays bf16, and so do the rows the loss takes from it and their gradient, held at the end of
    the forward, where the step's memory peaks: ~0.2 GiB per 4K-token sample at Qwen3.6-27B's
    shapes. The loss's matmuls ran in bf16 either way (the same numbers)."""
    ddp_model, optimizer = acc.prepare(model, optimizer)
    acc.unwrap_model(ddp_model, keep_fp32_wrapper=False)  # puts the drafter's own forward back
    return ddp_model, optimizer


def drafter_target(run: RunConfig, dataset: dict[str, Any] | None = None) -> dict[str, Any]:
    """What the drafter's config records of its target: where to find it (`eval`'s default --model),
    the run's TARGET_FACTS, which `eval` checks its --model against (`target_differences`), and the
    chat-template settings the run's chats were rendered with (a regeneration's, e.g. Qwen3.6's
    enable_thinking false), which `eval` renders its prompts with."""
    kwargs = (dataset or {}).get("chat_template_kwargs")
    return {"model": run.model, "gguf_file": run.gguf_file, "model_type": run.model_type,
            "final_state": run.final_state, **{k: getattr(run, k) for k in TARGET_FACTS},
            **({"chat_template_sha256": run.chat_template_sha256} if run.chat_template_sha256 else {}),
            **({"chat_template_kwargs": kwargs} if kwargs else {})}


def target_differences(recorded: dict[str, Any], info: dict[str, Any], whose: str) -> list[str]:
    """How the target `info` describes (`load_target`'s, computed from its config and tokenizer
    alone) differs from the TARGET_FACTS `recorded`: one "what: {whose} X, --model's Y" each
    (`warn_of_model_type` tells of another model type). A fact
    either side does not know (an older run, a GGUF's config, a folder without a revision or without
    tokenizer files) is not compared, as extraction's resume does (`IF_RECORDED`)."""
    if info["tokenizer_vocab_size"] < 2:  # no tokenizer files: an empty one, nothing to compare (`mask_token_id`)
        info = {**info, "tokenizer_sha256": None}
    return [f"{what}: {whose} {recorded[k]}, --model's {info[key]}" for k, (key, what) in TARGET_FACTS.items()
            if recorded.get(k) is not None and info.get(key) is not None and info[key] != recorded[k]]


def warn_of_model_type(recorded: dict[str, Any], info: dict[str, Any], whose: str, given: str) -> None:
    """Without a config.json hash on both sides (a GGUF run or --model), the model type: another
    architecture of the same width and tokenizer (a Qwen2 beside a GGUF Llama's run) trained and
    decoded without a word. A warning, not a refusal: transformers loads some GGUFs as another type
    than their HF folder says (a Mistral GGUF as llama), the same weights."""
    if None in (recorded.get("model_config_sha256"), info.get("model_config_sha256")) and \
            None not in (recorded.get("model_type"), info.get("model_type")) and \
            recorded["model_type"] != info["model_type"]:
        log.warning("the target %s is a %r, and %s target a %r: is --model the same model (a GGUF and its HF folder "
                    "may name their types apart)? Its embeddings and head are what the drafter learns against",
                    given, info["model_type"], whose, recorded["model_type"])


def check_same_target(cfg: TrainConfig, run: RunConfig) -> None:
    """Refuse a --model other than the run's target: another model of the same width trained to
    exit 0 against the wrong embeddings and head, and the drafter's config named the run's model."""
    facts = {k: getattr(run, k) for k in (*TARGET_FACTS, "model_type")}
    if all(v is None for v in facts.values()):
        return
    from layertap.extract.model import load_target

    info = load_target(cfg.model, cfg.gguf_file, weights=False).info
    diffs = target_differences(facts, info, "the run's")
    given = cfg.model + (f" ({cfg.gguf_file})" if cfg.gguf_file else "")
    warn_of_model_type(facts, info, "the run's", given)
    if diffs:
        was = run.model + (f" ({run.gguf_file})" if run.gguf_file else "")
        raise InputError(f"the target {given} is not the one the run at {cfg.data} was extracted from ({was}): "
                         f"{'; '.join(diffs)}. The drafter learns from that model's states with its embeddings and "
                         "head: pass --model (and --gguf-file) with the model the run was extracted with")


def _check_objective(cfg: TrainConfig, final_state: str) -> None:
    """Distillation needs the target's final-layer state, which only an extraction asked for it stores."""
    if cfg.objective != "ce" and final_state == "none":
        raise ConfigError(f"--objective {cfg.objective} learns the target's next-token distribution, computed from "
                          f"its final-layer state, which the run at {cfg.data} did not store: extract with "
                          "--final-state prenorm (or postnorm), or train with --objective ce")


def build_distill(cfg: TrainConfig, final_state: str) -> Distill | None:
    """The teacher side of the objective (None for ce); a prenorm state needs the target's final norm."""
    if cfg.objective == "ce":
        return None
    norm = load_final_norm(cfg.model, cfg.gguf_file) if final_state == "prenorm" else None
    transform = head_transform(cfg.model, cfg.gguf_file)
    if not transform.identity:
        log.info("the target's forward transforms its head's logits (%s): the teacher's are made the same way",
                 transform)
    return Distill.of(cfg.objective, cfg.distill_temperature, norm, scale=transform.scale, softcap=transform.softcap)


def _objective_text(cfg: TrainConfig, final_state: str) -> str:
    if cfg.objective == "ce":
        return "ce (cross-entropy on the data's next tokens)"
    return (f"{cfg.objective} (KL from the target's distribution through its frozen "
            f"{'final norm and ' if final_state == 'prenorm' else ''}head, {final_state} final states, "
            f"temperature {cfg.distill_temperature:g})")


class _Metrics:
    """Rank 0's per-step records: logged, kept as JSON lines, mirrored to TensorBoard if installed."""

    def __init__(self, lines: list[str], log_dir: str, asked: bool = False):
        self.lines = lines
        self.tb = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(f"{log_dir}/tensorboard")
        except ImportError:  # said where --log-dir was given, which then holds nothing
            log.log(logging.WARNING if asked else logging.DEBUG, "tensorboard is not installed: nothing is written "
                    "under --log-dir %s (the metrics are in metrics.jsonl of --out; `pip install tensorboard` "
                    "mirrors them there)", log_dir)

    def close(self) -> None:
        """TensorBoard's last events written out (its writer flushes every 120 s from a thread; a
        finished rank of several leaves by os._exit, train/command.py)."""
        if self.tb is not None:
            self.tb.close()
            self.tb = None

    def add(self, record: dict[str, Any]) -> None:
        # Strict JSON: a NaN or infinite value (a step of padding alone has no loss; a diverged
        # one) is written as null, which jq, JavaScript and other languages' parsers read.
        self.lines.append(json.dumps(_json_ready(record), allow_nan=False))
        if self.tb is not None:
            for k in ("loss", "lr", "grad_norm", "tokens_per_s", "data_wait_fraction", "acc_first"):
                self.tb.add_scalar(f"train/{k}", record[k], record["step"])


def _json_ready(value: Any) -> Any:
    """`value` with every non-finite float (in lists and dicts too) replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _json_ready(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_ready(v) for v in value]
    return value


def train(cfg: TrainConfig) -> int:
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs

    cuda = torch.cuda.is_available()
    precision = ("bf16" if cuda else "no") if cfg.mixed_precision == "auto" else cfg.mixed_precision
    acc = Accelerator(mixed_precision=precision, cpu=not cuda,
                      kwargs_handlers=[DistributedDataParallelKwargs(broadcast_buffers=False)])
    if acc.gradient_accumulation_steps != 1:  # set by `accelerate launch --gradient_accumulation_steps K`
        raise ConfigError(f"accelerate's gradient accumulation is set to {acc.gradient_accumulation_steps} "
                          "(ACCELERATE_GRADIENT_ACCUMULATION_STEPS, from `accelerate launch "
                          "--gradient_accumulation_steps`): it would divide every gradient by it on top of layertap's "
                          "own; leave it out and give `layertap train --grad-accum` instead")
    if not acc.is_main_process and logging.getLogger().getEffectiveLevel() > logging.DEBUG:
        # each rank said what rank 0 says ("resumed from ...", the target's files read): N times over; -v shows them
        logging.getLogger("layertap").setLevel(logging.WARNING)
    out = open_configured_store(cfg.out, cfg.s3)
    data = open_configured_store(cfg.data, cfg.s3)
    # recorded in checkpoints and compared on --resume: `run1`, `run1/` and its absolute path are one run
    cfg.data = data.uri
    check_apart(out, data)
    # A wrong or unreachable --data fails here, before --out holds anything (a refused command
    # left a lease folder behind); a follow trainer may wait for the run to be planned.
    try:
        run = None if cfg.follow else load_manifest(data)
    except NoRun as e:  # a training output or a folder of runs given: said as such, as `status` says it
        from layertap.manifests.cli import not_a_run

        raise not_a_run(data, e, "train learns from", lambda run: f"it trained on {run}, which --data may name") \
            from None
    # Before the steps (waiting for a run to follow, loading the target head) and after them (the
    # export), a stop signal ends the command at once, the lease released on the way out; during
    # them the loop's own StopSignals stops at a step boundary, with a checkpoint.
    try:
        with StopSignals(at_once=True), OutputLease(out) if acc.is_main_process else nullcontext() as lease:
            code = None
            try:
                _held_by_rank_0(acc)
                code = _train(cfg, acc, precision, out, data, lease, run)
                return code
            finally:
                # stopped, stalled, failed, Ctrl-C: rank 0, while the output is still its own (a trainer refused
                # it or taken over withdraws no one's claim, nor one a trainer started after its release took)
                if code != 0 and lease is not None and cfg.delete_consumed and lease.holds():
                    _give_up_claim(data, out)
    except Preempted as e:
        log.warning("%s outside the training steps: nothing to checkpoint; the same command%s starts again", e,
                    " with --resume" if cfg.resume else "")
        return e.exit_code
    except Exception as e:
        if acc.num_processes > 1 and collective_failed(e):
            log.debug("the collective's error", exc_info=e)
            raise ranks_lost(acc, e, _latest_step(out), out.uri) from None
        raise


def _latest_step(out: ObjectStore) -> int | None:
    """The step `--resume` would continue from (`load_latest`: latest.json, else the newest complete
    checkpoint), for a message; None where there is none, or it cannot be read."""
    try:
        ckpt = load_latest(out, tensors=False)
    except UserError:
        return None
    return ckpt.step if ckpt is not None else None


def _give_up_claim(data: ObjectStore, out: ObjectStore) -> None:
    """A --delete-consumed trainer that stops before its first checkpoint (it deletes data only after
    one), on a stall, a signal or an error, leaves its output empty: its claim on the run then read as
    a trainer still running (one not seen from here), so the extraction behind the full window waited
    for good without a word, and `status` said training consumed. Withdrawn, the run has no trainer:
    both say so, and the next one may claim it (this one again, or one with other settings)."""
    from layertap.manifests import layout
    from layertap.manifests.consumption import consumer_of, watermarks

    try:
        # any file of a checkpoint (one without latest.json resumes too), or a watermark of this output (it
        # consumed): the claim is what keeps its deletions counted, and its resume the run's
        if consumer_of(data) == out.uri and next(iter(out.list("checkpoints/")), None) is None \
                and not any(m.get("output") == out.uri for m in watermarks(data).values()):
            data.delete(layout.CONSUMER)
            log.warning("withdrew this trainer's claim on %s (%s): it stopped before its first checkpoint, having "
                        "deleted nothing; a --delete-consumed trainer started again (with any settings) claims the "
                        "run anew", data.uri, layout.CONSUMER)
    except Exception as e:  # noqa: BLE001 - the stop is what to report; the claim stays (status may call it running)
        log.warning("could not withdraw this trainer's claim on %s: %s", data.uri, e)


def _held_by_rank_0(acc: Any) -> None:
    """Every rank waits while rank 0 takes the output (up to a lease's ttl), then reads it: a rank
    that read the checkpoints meanwhile could resume from another step than rank 0 (a trainer
    finishing under the lease). Rank 0 refused, its error ends the launch (torchrun stops the rest)."""
    if acc.num_processes > 1:
        acc.wait_for_everyone()


def _train(cfg: TrainConfig, acc: Any, precision: str, out: ObjectStore, data: ObjectStore,
           lease: OutputLease | None, run: Manifest | None) -> int:
    """`train` once rank 0 holds the output; `run`: the data's manifest, None for a follow trainer."""
    cuda = torch.cuda.is_available()
    rank, world = acc.process_index, acc.num_processes
    run = run if run is not None else wait_for_manifest(data, cfg.follow_poll_s, quiet=rank > 0)
    if cfg.model is None:
        cfg.model, cfg.gguf_file = recorded_target(run.config, f"the run at {cfg.data} was extracted from",
                                                   "the run's manifest")

    if rank == 0:
        # A save killed while it streamed a file left it pending (a local temp file, an S3 upload: up
        # to ~15 GB at 27B) where no prune looks. Rank 0 holds the output, and no save runs yet.
        if gone := out.abort_pending_uploads():
            log.info("removed %d unfinished file(s) a stopped save left in %s", gone, cfg.out)
    try:
        ckpt, failed = load_latest(out, tensors=rank == 0), None  # the other ranks receive them (`broadcast_tensors`)
    except Exception as e:
        ckpt, failed = None, e
    agree_on_checkpoint(acc, ckpt.step if ckpt is not None else None, failed, cfg.out)
    if ckpt is not None and not cfg.resume:
        raise ConfigError(f"{cfg.out} already holds checkpoints (latest: step {ckpt.step}); pass --resume to continue "
                         "that run, or choose another --out")
    if ckpt is None and cfg.resume and rank == 0:  # a Slurm job passes --resume from its first start on: no news there
        log.log(logging.INFO if os.environ.get("SLURM_JOB_ID") else logging.WARNING,
                "--resume: %s holds no checkpoint, so training starts at step 0 (a typo in --out would start a long "
                "run over; check it if a run was expected there)", cfg.out)
    _check_objective(cfg, run.identity.final_state)
    if ckpt is not None:
        _check_resumable(ckpt.state, cfg, world)
    elif cfg.follow:  # two listings of the run: once, on rank 0, whose refusal every rank says
        refused = None
        if rank == 0:
            try:
                _check_left_to_train(data, run)
            except Exception as e:  # noqa: BLE001 - a store failing too: said by every rank, not a lost one
                refused = e
        raise_if_any_refused(acc, refused, f"to train on {data.uri}")
    # The run's committed shards before the target: a run with none fails in seconds, not after
    # the target head has loaded.
    stream = open_stream(cfg, acc)
    model = build_drafter(cfg, run.identity, ckpt.state["drafter"] if ckpt else None, acc.device,
                          torch.bfloat16 if precision == "bf16" else torch.float32, run.dataset)
    model.to(acc.device)
    distill = build_distill(cfg, run.identity.final_state)
    distill = distill.to(acc.device) if distill is not None else None
    params = [p for p in model.parameters() if p.requires_grad]
    # fused on CUDA: one kernel, and none of the foreach path's temporaries the size of all weights
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=cuda)
    ddp_model, optimizer = prepare(acc, model, optimizer)

    # collate writes the states into pinned memory where it runs in this process (no workers)
    loader = StreamLoader(stream, batch_size=cfg.batch_size, num_workers=cfg.num_workers,
                          collate_fn=partial(collate, pin_memory=cuda and cfg.num_workers == 0))
    # with --follow: the follow epoch's batches, computed from the samples the manifest's plan stores
    steps_per_epoch = -(-len(loader) // cfg.grad_accum)  # the last takes the batches left (`train_step`)
    total = cfg.steps or cfg.epochs * steps_per_epoch
    if cfg.delete_consumed and total != steps_per_epoch:
        raise ConfigError(
            f"--delete-consumed with --steps {total}: the follow epoch has {steps_per_epoch} steps, and "
            + ("later steps would need the deleted data" if total > steps_per_epoch else
               "stopping before its end leaves the rest of the run unconsumed, so an extraction under --window "
               "would wait for a trainer that has left")
            + f"; leave out --steps (or give {steps_per_epoch}), or leave out --delete-consumed")
    lines: list[str] = []
    start = 0
    if ckpt is not None:
        start = ckpt.step
        try:
            total = _resume_loader(cfg, loader, load_loader_state(out, ckpt, rank), start, total, steps_per_epoch)
            refused = None
        except Exception as e:  # every rank hears of it: the others would wait in the broadcast until gloo/NCCL gave out
            refused = e
        raise_if_any_refused(acc, refused, f"the resume from {cfg.out} step {start}")
        broadcast_tensors(acc, (ckpt.weights, ckpt.optimizer))  # read by rank 0 alone
        restore(ckpt, model, optimizer)
        ckpt.weights.clear()  # copied into the model and optimizer: ~22 GB of host memory at 27B shapes, held
        ckpt.optimizer.clear()  # to the end of training otherwise
        if rank == 0:
            _tell_schedule_change(cfg, start, ckpt.state.get("total_steps"), total)
            lines = _metrics_until(out, start)
            if start < total and withdraw_export(out):
                log.info("removed the drafter exported at step %d (%s/drafter/): training goes on to step %d and "
                         "exports it again at its end", start, cfg.out, total)
        log.info("resumed from %s/checkpoints step %d", cfg.out, start)
    _check_consumer(cfg, data, out.uri, rank, world, run.largest_shard_bytes, fresh=ckpt is None)
    if rank == 0:
        samples = run.planned_records if cfg.follow else stream.total_samples
        log.info("drafter: %d layers, %s trainable parameters, block %d; %d samples per epoch over %d rank(s); "
                 "%d step%s (%d per epoch)", model.config.num_layers, f"{num_parameters(model):,}",
                 model.config.block_size, samples, world, total, "" if total == 1 else "s", steps_per_epoch)
        log.info("objective: %s", _objective_text(cfg, run.identity.final_state))
        if samples < (per_step := cfg.batch_size * world * cfg.grad_accum):
            log.warning("a step takes %d samples (--batch-size %d x %d rank(s) x --grad-accum %d), more than the %d of "
                        "an epoch: each epoch is one step; a smaller --batch-size makes more steps of it", per_step,
                        cfg.batch_size, world, cfg.grad_accum, samples)
        if cfg.steps is not None and cfg.epochs != TrainConfig.epochs:
            log.warning("--steps %d and --epochs %d: --steps decides how long training runs (%d steps, %.1f epochs); "
                        "leave one out", cfg.steps, cfg.epochs, cfg.steps, cfg.steps / max(1, steps_per_epoch))
    metrics = _Metrics(lines, cfg.log_dir, asked=cfg.log_dir != TrainConfig.log_dir) if rank == 0 else None

    # follow mode: a step's every batch prefetched, so `_await_data` waits for them all at the step boundary
    depth = prefetch_depth(cfg.grad_accum) if cfg.follow else 2
    with StopSignals(at_once=False) as stop, \
            Prefetcher(loader, acc.device, depth=depth, end_epoch=cfg.epochs if cfg.steps is None else None) as batches:
        return _loop(_Run(cfg=cfg, acc=acc, ddp_model=ddp_model, model=model, params=params, optimizer=optimizer,
                          batches=batches, out=out, metrics=metrics, stop=stop, total=total, stream=stream,
                          data=data, distill=distill, lease=lease), start)


def _epoch_number(epoch: Any) -> Any:
    """An epoch as `status` and the progress line count it, from 1 (metrics.jsonl and loader states
    count from 0)."""
    return epoch + 1 if isinstance(epoch, int) else epoch


def _resume_loader(cfg: TrainConfig, loader: StreamLoader, state: dict[str, Any], step: int, total: int,
                   steps_per_epoch: int) -> int:
    """This rank's loader at the checkpoint of `step`; returns the run's last step. Extraction may
    have committed more shards since: an epoch the checkpoint had not begun streams them all (its
    order is computed afresh), and with --epochs the steps left are those of the epochs left at
    today's size (its shards and --num-workers); an epoch begun cannot continue over another set
    (the stream refuses it)."""
    saved_run = state.get("run_id")
    if saved_run is not None and saved_run != loader.stream.run_id:  # deleted and extracted anew since
        raise InputError(f"cannot resume {cfg.out} from its checkpoint at step {step}: it trained on run {saved_run} "
                         f"at {cfg.data}, which now holds another run ({loader.stream.run_id}, extracted since): "
                         f"train on it from the start into another --out (or delete {cfg.out}/checkpoints)")
    try:
        loader.load_state_dict(state)
    except ShardsChanged as e:
        raise InputError(
            f"cannot resume {cfg.out} from its checkpoint at step {step}: it was saved in the middle of epoch "
            f"{_epoch_number(state.get('epoch'))}, which streams {e.saved} of {cfg.data}, and the run has "
            f"{loader.stream.total_samples} samples in {len(loader.stream.shards)} committed shards now (extraction "
            "went on after training started, or `verify` withdrew a shard that was extracted again). An epoch's "
            "order depends on its shards, so it cannot go on over "
            f"the new ones: train from the start on all of them (another --out, or delete {cfg.out}/checkpoints). "
            "A checkpoint at an epoch's end would resume on them"
            + (" (with --follow, an epoch after the follow epoch goes on over the shards it began with, but not "
               "over one redone with other samples)" if cfg.follow else "; to train while a run is extracted, use "
               "--follow")
        ) from None
    if cfg.follow and cfg.steps is None and loader.epoch >= cfg.epochs:
        # Saved at the end of the last follow epoch, which ended sooner than the plan allowed for
        # (`_loop`): the run is done, and a restart (a requeue) must not count steps past it,
        # withdraw the export and wait for data it will not train on.
        total = min(total, step)
    at_epoch_start = not any(state.get("consumed") or [])
    if cfg.steps is None and not cfg.follow and at_epoch_start:
        # the epochs left at today's size: more shards committed, or another --num-workers, which
        # splits an epoch into another count of batches (0 workers: 10 of 40 samples at batch size 4, 3: 12)
        total = step + max(0, cfg.epochs - loader.epoch) * steps_per_epoch
    changed = loader.stream.shards_changed
    if changed is not None:
        log.info("the run's committed shards changed since the checkpoint (%s then, %d shards, %d samples now): "
                 "epoch %d on streams them all, %d steps each; training ends at step %d", changed,
                 len(loader.stream.shards), loader.stream.total_samples, loader.epoch + 1, steps_per_epoch, total)
    if step > total:
        _refuse_going_back(cfg, step, total, steps_per_epoch)
    return total


def _tell_schedule_change(cfg: TrainConfig, step: int, saved_total: Any, total: int) -> None:
    """A resume that trains to another last step than the checkpoint's run would have (another
    --steps, an epoch grown by shards committed since) lays the learning-rate schedule over it, and
    the lr jumps: said, with both lrs, rather than left to a loss curve to show."""
    if type(saved_total) is not int or saved_total == total or step >= total:
        return
    log.warning("training now ends at step %d, where the checkpoint's run was to end at step %d: the learning-rate "
                "schedule (warmup, cosine decay to the last step) is laid over %d steps, so step %d runs at lr %.2e "
                "instead of %.2e", total, saved_total, total, step + 1, lr_at(step, total, cfg),
                lr_at(step, saved_total, cfg))


def _refuse_going_back(cfg: TrainConfig, step: int, total: int, steps_per_epoch: int) -> None:
    """A resume whose checkpoint is past the steps asked for printed "trained N steps" and exported
    the checkpoint's weights as if trained to N: refused (exit 2), since the output cannot hold what
    the command asks for, and a pipeline must not go on as if it did. At the end exactly, the
    resume is a no-op (a finished job started again): `_loop` says so and exits 0."""
    asked = f"--steps {cfg.steps}" if cfg.steps else f"--epochs {cfg.epochs} ({steps_per_epoch} steps each)"
    raise ConfigError(f"the latest checkpoint in {cfg.out} is at step {step}, past the {total} steps of {asked}: "
                      f"training cannot go back. Pass --steps {step} or more to continue it (--steps {step}: "
                      f"nothing to train, its drafter exported), or another --out to train {total} steps from the "
                      "start (an earlier kept checkpoint evaluates with `layertap eval --step N`)")


def open_stream(cfg: TrainConfig, acc: Any) -> ShardStream:
    """This rank's stream over the shards rank 0 found committed, the same on every rank.

    Ranks that each read the commits of a run still being extracted would see different shards
    (one committed in between): epochs of different sizes and orders, samples trained twice or
    never, step counts that differ and hang the last reduce. So rank 0 reads them and refreshes
    the commit index (a restart then reads one listing and one GET), and hands its list to the
    others, which read no commit. Follow mode's first epoch finds shards as it goes; later epochs
    read the complete run, rank 0 alone again (`ShardStream.agree`)."""
    rank, world = acc.process_index, acc.num_processes
    config = StreamConfig(seed=cfg.seed, shuffle_buffer=cfg.shuffle_buffer, memory_budget=cfg.memory_budget,
                          fetch_threads=cfg.fetch_threads, follow=cfg.follow, follow_poll_s=cfg.follow_poll_s,
                          deletes_consumed=cfg.delete_consumed)
    shards = None
    if rank == 0:
        stream = ShardStream(cfg.data, config=config, rank=rank, world_size=world, store_options=cfg.s3)
        stream.refresh_index()
        shards = None if cfg.follow else stream.shard_records
    shards = from_rank_0(acc, shards)
    if rank != 0:
        stream = ShardStream(cfg.data, config=config, rank=rank, world_size=world, store_options=cfg.s3,
                             committed=shards)
    # a check of the above: any difference would show only as wrong training, or a hang at the end
    facts = [int(stream.fingerprint, 16) >> 1, stream.total_samples]  # >> 1: an int64
    seen = per_rank(acc, facts, torch.int64)
    if any(row != seen[0] for row in seen):
        raise RuntimeError(f"the ranks stream different shards of {cfg.data} (samples per rank "
                           f"{[n for _, n in seen]}, shard fingerprints {len({f for f, _ in seen})} distinct)")
    if cfg.follow and world > 1:
        # The epochs after the follow epoch read the committed shards again, when the prefetch thread
        # reaches them (or at a resume into one): rank 0's list, handed over as above. Through a group
        # of its own: that thread must not interleave NCCL calls with the training thread's.
        group = host_group(acc)
        stream.agree = lambda mine: from_rank_0(acc, mine, group)
    return stream


@dataclass
class _Run:
    """What the steps and checkpoints of one training process work on."""

    cfg: TrainConfig
    acc: Any  # accelerate.Accelerator
    ddp_model: torch.nn.Module
    model: DFlashDrafter
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    batches: Prefetcher
    out: ObjectStore
    metrics: _Metrics | None  # rank 0 only
    stop: StopSignals
    total: int  # the last step
    stream: ShardStream
    data: ObjectStore  # the run being trained on
    distill: Distill | None = None  # --objective kl|ce+kl: the teacher side
    lease: OutputLease | None = None  # rank 0's hold on --out
    saving: bool = False  # a checkpoint is being written: its lease's beats say so (a long save is no hang)


@dataclass
class StepStats:
    """One step's numbers, summed over the ranks."""

    step: int  # the step just taken (1-based)
    totals: torch.Tensor  # [loss x weight, weight, tokens, hits per slot, counted per slot, kl x weight]
    lr: float
    grad_norm: float
    seconds: float
    samples_digest: str  # this rank's sample ids
    stop: bool  # some rank was told to stop


def train_step(run: _Run, step: int, distill: Distill | None = None) -> StepStats:
    """Step `step` (0-based): `grad_accum` micro-batches (fewer at the end of an epoch), the
    weighted mean gradient over all of them on all ranks (`_normalize_gradients`), clip, AdamW. Nothing in it waits for the GPU but the one reduce at its end: its numbers are summed
    on the device (host-known ones on the host) and read back together. `distill`: the KL
    objective's teacher (None: CE)."""
    cfg, acc, device = run.cfg, run.acc, run.acc.device
    bs = run.model.config.block_size
    t0 = time.perf_counter()
    lr = lr_at(step, run.total, cfg)
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    # [loss x weight, weight, tokens, hits per slot, counted per slot, kl x weight, grad norm, stop]
    on_device = torch.zeros(6 + 2 * bs, dtype=torch.float64, device=device)
    on_host = torch.zeros(6 + 2 * bs, dtype=torch.float64)
    seen = xxhash.xxh64()
    for micro in range(cfg.grad_accum):
        batch = run.batches.wait_for_batch()
        _check_token_ids(batch, run.model.embed.shape[0], cfg)
        seen.update("\n".join(batch["sample_id"]).encode() + b"\n")
        # the epoch's last batch ends the step: the next epoch's first step starts with the next
        last = micro == cfg.grad_accum - 1 or batch.get("ends_epoch", False)
        sync = nullcontext() if last else acc.no_sync(run.ddp_model)
        with sync:
            with acc.autocast():
                result = dflash_loss(run.ddp_model, batch, anchor_generator(cfg.seed, step, micro, acc.process_index),
                                     distill=distill, mean=False)
            acc.backward(result.loss)  # weighted sums, unscaled; normalized below
        on_device[0] += result.loss.detach().double()
        on_device[3:3 + bs] += result.correct
        if result.kl is not None:
            on_device[3 + 2 * bs] += result.kl.double()
        on_host[1] += result.weight
        pads = batch.get("padding")  # real tokens: not the zero-weighted pads (collate marks them)
        on_host[2] += int((batch["lengths"] if pads is None else batch["lengths"][~pads]).sum())
        on_host[3 + bs:3 + 2 * bs] += result.counted
        del batch, result  # the states on the GPU go back to the allocator before the next batch
        if last:
            break
    _normalize_gradients(run, on_host[1])
    grad_norm = acc.clip_grad_norm_(run.params, cfg.max_grad_norm)
    # Nothing to learn (every sample a zero-weighted pad, e.g. the end of a follow epoch sized
    # from the plan when extraction skipped rows): the gradients are zero, but AdamW would still
    # move the weights (decay, momentum), so the step is skipped. Every rank decides alike: the
    # norm is of the gradients DDP has already averaged. Reading it waits for the backward.
    if 0 < float(grad_norm) < math.inf:  # an infinite norm: clipping makes NaN gradients of it
        run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    on_device[-2] = grad_norm / acc.num_processes  # the same on every rank (DDP): each adds its share
    on_host[-1] = float(run.stop.requested is not None)
    totals = acc.reduce(on_device + on_host.to(device, non_blocking=True), reduction="sum").cpu()
    return StepStats(step + 1, totals[:-2], lr, float(totals[-2]), time.perf_counter() - t0, seen.hexdigest(),
                     bool(totals[-1] > 0))


def _normalize_gradients(run: _Run, weight: torch.Tensor) -> None:
    """Make the step's gradient the weighted mean over every supervised slot of every micro-batch
    on every rank: each slot counts alike, however the slots fall into micro-batches and ranks.
    A mean per micro-batch, averaged, gave a slot of a short micro-batch more say than one of a
    long one, and a micro-batch of zero-weighted pads (the end of a follow epoch) diluted the
    rest. The losses were backpropagated as weighted sums, so the float32 gradients are scaled
    here, once: by the ranks (DDP averaged them) over the step's total weight, summed across the
    ranks on the device (no wait for the GPU). A bf16 backward would round a scaled loss's factor
    (1/3 -> 0.33398). No weight anywhere: the gradients are zero, and stay so."""
    acc = run.acc
    total = acc.reduce(weight.reshape(1).to(acc.device, non_blocking=True), reduction="sum")[0]
    scale = torch.where(total > 0, acc.num_processes / total, torch.zeros_like(total)).float()  # 0-dim
    for p in run.params:
        if p.grad is not None:
            p.grad.mul_(scale)


def _check_token_ids(batch: dict[str, Any], vocab: int, cfg: TrainConfig) -> None:
    """Every token id of the batch inside the target's vocabulary (on the host: the ids stay there).
    The drafter embeds them: beyond it, an IndexError traceback on CPU and a device-side assert on
    CUDA, which ends the process with no checkpoint and no word of which sample or why. A run made
    with another target passes the target check only where its manifest recorded no hashes (a run
    written by hand or by a tool of one's own)."""
    ids = batch["input_ids"]
    top = int(ids.max()) if ids.numel() else -1
    if top >= vocab:
        row = int((ids >= vocab).any(dim=1).nonzero()[0])
        raise InputError(f"sample {batch['sample_id'][row]!r} of {cfg.data} holds token id {top}, outside the "
                         f"vocabulary of the target {cfg.model} ({vocab} ids): the run was made with another "
                         "tokenizer or target; pass --model with the model the run was extracted from")


def _loop(run: _Run, start: int) -> int:
    """The steps, with rank 0's metrics, the checkpoints and a stop at a step boundary."""
    cfg, acc = run.cfg, run.acc
    progress = _progress(acc.process_index, start, run.total)
    step = saved = start
    if cfg.delete_consumed and start > 0:
        _check_data_left(run, start)
        # Watermarks are written after a checkpoint; one resumed from (perhaps by a trainer that ran
        # without --delete-consumed) may have none yet, and a full window would then wait for good.
        _delete_consumed(run, start)
    nonfinite = 0  # steps in a row whose loss or gradient was NaN or infinite
    # its lease's beats say how long ago the last step ended (`status` of the output shows it), and whether
    # the ranks wait for data: in the wait, with a reduce of the ranks' flags returned lately (a rank that
    # hangs holds the others in that reduce, which is no wait for data)
    last = {"step": step, "at": time.monotonic(), "in_wait": False, "agreed": 0.0}
    if run.lease is not None:
        run.lease.progress = lambda: {
            "step": last["step"], "step_age_s": round(time.monotonic() - last["at"], 1),
            "waiting_for_data": last["in_wait"] and time.monotonic() - last["agreed"] < WAIT_AGREED_S,
            "saving_checkpoint": run.saving}
    while step < run.total:
        awaited = time.perf_counter()  # follow mode waits for the step's batches here, not in `train_step`
        last["in_wait"] = cfg.follow
        stopped, saved = _await_data(run, step, saved, lambda: last.update(agreed=time.monotonic())) \
            if cfg.follow else (False, saved)
        last["in_wait"] = False
        awaited = time.perf_counter() - awaited
        if not stopped:
            epoch = run.batches.epoch  # the step's: once it has taken an epoch's last batch, the next
            if cfg.follow and cfg.steps is None and epoch >= cfg.epochs:
                # The steps were counted as --epochs follow epochs, padded to the plan; later epochs hold
                # only the committed samples, so the last one ends sooner: end there, not in one more.
                if acc.is_main_process:
                    log.info("the last epoch ended at step %d (of the %d the plan allowed for): training ends",
                             step, run.total)
                run.total = step
            else:
                first = step == start
                if first and acc.is_main_process and acc.device.type == "cuda":
                    log.info("step %d: the first step on a GPU compiles flex attention's kernels first (17 s on an "
                             "H200 at Qwen3.6-27B's shapes)", step + 1)
                stats = train_step(run, step, run.distill)
                # the wait counts in the step's time, as `pop_wait_s` counts it in the wait: left out, a step that
                # waited 14 s for extraction showed 0.05 s, its tokens/s as if it had not, and a wait of 100%
                stats.seconds += awaited
                if first and acc.is_main_process:
                    log.info("step %d took %.1f s", stats.step, stats.seconds)
                step, stopped = stats.step, stats.stop
                last.update(step=step, at=time.monotonic())
                nonfinite = _check_finite(run, stats, nonfinite)
                wait = run.batches.pop_wait_s()
                if run.metrics is not None:
                    _report(run, stats, epoch, wait, progress)
        if (step % cfg.save_every == 0 or step == run.total or stopped) and step > saved:
            _save(run, step)
            saved = step
        if stopped and step < run.total:  # a stop with the last step: the run ends as it would have, exported
            if acc.is_main_process and saved == 0:  # every rank stops here; one says so
                log.warning("stopped by a signal before the first step: nothing to checkpoint; the same `layertap "
                            "train` command starts again")
            elif acc.is_main_process:
                log.warning("stopped at step %d by a signal; the same `layertap train` command with --resume "
                            "continues (the same options, --steps among them: another --steps plans the schedule "
                            "anew)%s", step, f"; {RESUBMIT} (a requeued job resumes on its own)"
                            if os.environ.get("SLURM_JOB_ID") else "")
            progress.close()
            if run.metrics is not None:
                run.metrics.close()
            return run.stop.requested.exit_code if run.stop.requested is not None else 143  # another rank's signal
    progress.close()
    if acc.is_main_process:
        if run.lease is not None:
            run.lease.check()
        if start < run.total:
            export_drafter(run.out, run.model)
            loss, after = _final_loss([json.loads(line) for line in run.metrics.lines])
            ran = run.total - start
            steps = f"step {run.total}" if ran == 1 else f"steps {start + 1}-{run.total}"
            done = f"trained {ran} step{'s' if ran != 1 else ''}" + \
                (f" ({steps}: resumed at step {start})" if start else "") + \
                f"; final loss {'none' if math.isnan(loss) else f'{loss:.4f}'}{after}"
        else:  # a resume at the end (a finished job started again): say so, not "trained N steps"
            # an export present is this step's: a resume that trains on withdraws it (`withdraw_export`)
            exported = run.out.exists(EXPORT_CONFIG)
            if not exported:  # the run stopped between its last checkpoint and its export
                export_drafter(run.out, run.model)
            done = (f"nothing to train: the latest checkpoint in {run.out.uri} is at step {start}, where this run "
                    f"ends; its drafter was {'already exported' if exported else 'exported now'}")
        embedded = _on_embedded_data(run.stream.manifest)  # read at the start: the store may be gone by now
        print(f"{done}; drafter at {run.out.uri}/drafter/\n"
              f"evaluate it on held-out prompts ("
              + ("chats of the packaged ShareGPT it was not trained on" if embedded else "JSON lines of chats")
              + f"; the target is the one the drafter records, {cfg.model}"
              f"{f' ({cfg.gguf_file})' if cfg.gguf_file else ''}):\n"
              f"  layertap eval --drafter {run.out.uri} "
              + ("--prompts embedded --limit 32" if embedded else "--prompts HELD_OUT.jsonl"))
    if run.metrics is not None:
        run.metrics.close()
    # The prefetch thread ended before the process groups go (`end_training` destroys them, the thread's
    # gloo group among them): a 2-rank follow run aborted at exit ("terminate called without an active
    # exception") now and then. Closing twice (the `with` block's) does nothing more.
    run.batches.close()
    acc.wait_for_everyone()
    acc.end_training()
    return 0


def _final_loss(records: list[dict[str, Any]]) -> tuple[float, str]:
    """(the last finite loss, what the steps after it were), for the closing line. A step whose
    loss weight was zero (no supervised slot: `acc_per_position` all None) has a NaN loss and is
    no optimizer step: zero-weighted padding, e.g. for samples the extraction skipped. A NaN or
    infinite loss with weight behind it is a divergence (warned at each step, `_check_finite`):
    it must not be told as skipped data. metrics.jsonl writes such losses as null (older
    versions: NaN)."""
    finite = [i for i, r in enumerate(records) if r["loss"] is not None and math.isfinite(r["loss"])]
    last = records[finite[-1]] if finite else None
    after = records[finite[-1] + 1:] if finite else records
    empty = sum(padding_only(r) for r in after)
    parts = [f"{empty} step(s) had nothing to learn (zero loss weight: padding, e.g. for samples the extraction "
             "skipped)"] if empty else []
    if len(after) > empty:
        parts.append(f"{len(after) - empty} step(s) had a NaN or infinite loss and made no update (see the warnings)")
    where = f"step {last['step']}; after it, " if last is not None else "no step had a finite loss: "
    return (last["loss"] if last is not None else float("nan")), (f" ({where}{' and '.join(parts)})" if parts else "")


class NotFinite(UserError, FloatingPointError):
    """Training met NaN or infinite losses or gradients and stopped (`_check_finite`)."""


def _check_finite(run: _Run, stats: StepStats, before: int) -> int:
    """Steps in a row, to this one, whose loss or gradient was NaN or infinite. Such a step makes
    no update (`train_step` steps only on a finite, positive norm), which went unsaid: 'final loss nan',
    exit 0, a drafter exported untrained. Warned at each, and after `NONFINITE_LIMIT` in a row
    training stops: it will not mend by itself. The same on every rank (reduced numbers)."""
    weight, loss = float(stats.totals[1]), float(stats.totals[0])
    if math.isfinite(stats.grad_norm) and (weight == 0 or math.isfinite(loss)):
        return 0
    if run.acc.is_main_process:
        log.warning("step %d: the loss or the gradients are not finite (loss %s, gradient norm %s): no update",
                    stats.step, loss / weight if weight else loss, stats.grad_norm)
    if before + 1 < NONFINITE_LIMIT:
        return before + 1
    raise NotFinite(f"steps {stats.step - NONFINITE_LIMIT + 1}-{stats.step}: the loss or the gradients were NaN or "
                    f"infinite {NONFINITE_LIMIT} steps in a row, and none of them updated the drafter (its checkpoints "
                    "hold it as it was before them): NaN or infinite states in the data (`layertap inspect SHARD "
                    "--stats` shows max |x| per layer), or a --lr that diverged")


WAIT_AGREED_S = 120.0  # a wait for data whose ranks last agreed longer ago is taken for a hang (`_loop`)


def _await_data(run: _Run, step: int, saved: int, agreed: Callable[[], None] = lambda: None) -> tuple[bool, int]:
    """Follow mode, before step `step`: wait until every rank has the step's batches (all
    --grad-accum of them, or those to its epoch's end: a wait inside the step could neither stop
    nor checkpoint). Returns whether a stop signal came first (the caller then exits as after a
    step) and the last checkpoint's step.

    While a rank waits and extraction is held back by its storage window (`stalled`: the data at
    rest fills `--window`), training would wait for shards that extraction waits for training to
    free. With --delete-consumed the trainer then checkpoints at this step boundary (unless it
    has since `saved`): the shards it trained on count as consumed, their data is deleted and the
    window opens. Ranks decide together, by one small reduce per step and per `STALL_CHECK_S`
    seconds of waiting (none on one rank while its batch is there), and while any rank waits, rank 0
    looks for the stall and tells the others (a second reduce): whichever rank lacks its batch,
    not only rank 0 (ranks' shares of a follow run differ by a few samples at a stall). `agreed` is
    called as each reduce returns: the ranks are alive and waiting."""
    acc, world = run.acc, run.acc.num_processes

    def any_rank(*values: bool) -> list[bool]:
        flags = torch.tensor([float(v) for v in values], dtype=torch.float64, device=acc.device)
        return [float(x) > 0 for x in (acc.reduce(flags, reduction="sum") if world > 1 else flags)]

    while True:
        have = run.batches.ready(STALL_CHECK_S, run.cfg.grad_accum)
        if world == 1 and have:
            return False, saved
        missing, stop = any_rank(not have, run.stop.requested is not None)
        agreed()
        if stop or not missing:
            return stop, saved
        if not (run.cfg.delete_consumed and step > saved):
            continue
        [held] = any_rank(acc.is_main_process and _stalled(run.data))
        if held:
            if acc.is_main_process:
                log.info("the data at rest fills extraction's storage window while training waits for data: checkpoint "
                         "at step %d, so the shards trained on count as consumed and their data is deleted", step)
            _save(run, step)
            saved = step


def _on_embedded_data(manifest: Manifest) -> bool:
    """Whether the run was extracted from the packaged ShareGPT's first rows (the Quickstart's):
    `eval --prompts embedded` then holds chats it was not trained on."""
    from layertap.train.speculative import EMBEDDED_HELD_OUT_FROM

    dataset = manifest.dataset
    limit = dataset.get("limit")
    return dataset.get("path") == "embedded" and isinstance(limit, int) and limit <= EMBEDDED_HELD_OUT_FROM


def _stalled(store: ObjectStore) -> bool:
    """`consumption.stalled`, with a store failing past its retries taken for no stall: the next
    look, `STALL_CHECK_S` later, asks again (an outage ended the trainer)."""
    from layertap.manifests.consumption import stalled
    from layertap.storage.store import TransientStoreError

    try:
        return stalled(store) is not None
    except TransientStoreError as e:
        log.warning("could not look whether extraction waits for its storage window (%s); looking again", e)
        return False


def _report(run: _Run, stats: StepStats, epoch: int, wait: float, progress) -> None:
    """Rank 0: the step's record into metrics.jsonl, the bar, and a log line every `log_every`."""
    record = _record(stats, epoch, run.model.config.block_size, wait, kl=run.distill is not None)
    device = run.acc.device
    if device.type == "cuda":
        record["peak_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 3)
    record["samples_digest"] = stats.samples_digest  # rank 0's samples this step, to compare runs
    run.metrics.add(record)
    # a step of zero-weighted padding alone (samples the extraction skipped) has no loss: said, not "nan"
    counted = not padding_only(record)
    progress.set_postfix(loss=f"{record['loss']:.3f}" if counted else "none", acc=f"{record['acc_first']:.2f}",
                         tok_s=f"{record['tokens_per_s']:,.0f}", refresh=False)  # before the update, which prints
    progress.update(1)
    if stats.step % run.cfg.log_every == 0 or stats.step == run.total:
        loss = f"{record['loss']:.4f}" if counted else "none (padding only)"
        log.info("step %d/%d  loss %s  acc@1 %.3f  lr %.2e  %.0f tok/s  data wait %.0f%%", stats.step, run.total,
                 loss, record["acc_first"], stats.lr, record["tokens_per_s"], 100 * record["data_wait_fraction"])


def _record(stats: StepStats, epoch: int, bs: int, wait: float, kl: bool = False) -> dict[str, Any]:
    """The step's metrics.jsonl record; `kl`: with the KL part of the loss (distillation)."""
    t, elapsed = stats.totals, stats.seconds
    loss = float(t[0] / t[1]) if t[1] > 0 else float("nan")
    correct, counted = t[3:3 + bs], t[3 + bs:3 + 2 * bs]
    per_slot = [float(c / n) if n > 0 else None for c, n in zip(correct[1:], counted[1:])]
    extra = {"kl": float(t[3 + 2 * bs] / t[1]) if t[1] > 0 else float("nan")} if kl else {}
    return {"step": stats.step, "epoch": epoch, "loss": loss, **extra, "lr": stats.lr, "grad_norm": stats.grad_norm,
            "acc_first": per_slot[0] if per_slot[0] is not None else 0.0, "acc_per_position": per_slot,
            "tokens": int(t[2]), "tokens_per_s": float(t[2]) / elapsed if elapsed > 0 else 0.0,
            "step_s": elapsed, "data_wait_fraction": min(1.0, wait / elapsed) if elapsed > 0 else 0.0,
            "time": time.time()}


def _save(run: _Run, step: int) -> None:
    run.saving = True
    try:
        _write_checkpoint(run, step)
    finally:
        run.saving = False


def _write_checkpoint(run: _Run, step: int) -> None:
    acc = run.acc
    # DDP keeps replicas equal by construction; a checkpoint is where a silent divergence
    # (a rank that skipped a step, a non-deterministic kernel) would be frozen in: refuse it.
    # Beside each rank's weight sum, whether rank 0 lost its lease on --out: every rank stops then.
    # Beside them, rank 0's draw names this save's folder of loader positions: no save of the same
    # step (a trainer taken over that went on, a save killed half-way and redone) mixes into it.
    lost = float(run.lease is not None and not run.lease.holds())
    draw = float(random.SystemRandom().getrandbits(48)) if acc.is_main_process else 0.0  # exact in a float64
    rows = per_rank(acc, [sum(float(p.detach().double().sum()) for p in run.model.trainable_state().values()), lost,
                          draw])
    if any(taken for _, taken, _ in rows):
        raise taken_over(run.out)
    sums = [weights for weights, _, _ in rows]
    if len(set(sums)) > 1:
        raise RuntimeError(f"drafter replicas differ across ranks at step {step} (weight sums {sums}); "
                           "not saving a checkpoint from diverged ranks")
    # Each rank writes its own position (what it trained on, not what it prefetched), and says whether it
    # landed: one that could not must not leave the others waiting in a collective. The checkpoint counts
    # once state.json (naming the folder) and latest.json follow, after every rank's position landed.
    folder = f"loader/{int(rows[0][2]):012x}"
    try:
        save_loader_state(run.out, step, folder, acc.process_index, run.batches.state_dict())
        failed = None
    except Exception as e:
        failed = e
    wrote = [ok for (ok,) in per_rank(acc, [float(failed is None)])]
    if failed is not None:
        raise failed
    unwritten = [rank for rank, ok in enumerate(wrote) if not ok]
    if unwritten:
        raise StoreError(f"rank(s) {id_ranges(unwritten, 10)} could not write their loader position into the checkpoint at "
                         f"step {step} ({run.out.uri}/{step_prefix(step)}; their logs say why): not saving it")
    if acc.is_main_process:
        state = {"config": run.cfg.identity(), "world_size": acc.num_processes, "loader_states": folder,
                 "num_workers": run.cfg.num_workers, "total_steps": run.total}
        # metrics first: the checkpoint counts once `latest.json` names it, and a resume keeps the
        # metrics up to its step, so they must never lag behind it
        run.out.put(METRICS, ("\n".join(run.metrics.lines) + "\n").encode())
        prefix = save_checkpoint(run.out, Snapshot(step, run.model, run.optimizer, state), run.cfg.keep_checkpoints,
                                 check=run.lease.check if run.lease is not None else lambda: None)
        log.info("checkpoint %s/%s", run.out.uri, prefix)
    acc.wait_for_everyone()
    if run.cfg.delete_consumed:
        _delete_consumed(run, step)


def _check_data_left(run: _Run, step: int) -> None:
    """Refuse, on every rank, a --delete-consumed trainer resumed from a checkpoint older than the
    one after which it deleted data (the latest corrupt and latest.json pointed back at an earlier
    one, as its error offers): its ranks have yet to read shards that are gone. One rank left them
    out of its follow epoch with a warning while another failed mid-step on them, its peers with a
    collective's error, and `--resume` did the same again. What this trainer deleted after `step` is
    what its own watermarks of later steps name and a marker says is gone (rank 0 lists them, once);
    shards consumed before it started are no resume's to read."""
    acc = run.acc
    later: list[list[int]] = []
    if acc.is_main_process:
        try:
            later = _deleted_after(run, step)
        except Exception as e:  # noqa: BLE001 - a check: a store failing here fails the next read too
            log.warning("could not tell whether data this trainer needs was deleted after step %d: %s", step, e)
    later = from_rank_0(acc, later)
    if not later:  # the same answer on every rank: all return together
        return
    gone = {s for a, b in later for s in range(a, b + 1)}
    needed = sorted(gone - set(run.stream.consumed_shards(run.batches.state_dict())))
    ranks = [r for r, (n,) in enumerate(per_rank(acc, [float(len(needed))])) if n]
    if not ranks:
        return
    mine = f" (rank {acc.process_index}'s: shard(s) {listing(needed)})" if needed else ""
    raise InputError(f"cannot resume {run.out.uri} from step {step}: rank(s) {listing(ranks)} have yet to train on "
                     f"data this trainer deleted after a later checkpoint{mine}. Resume from that later checkpoint "
                     f"(checkpoints/latest.json names the one to resume from); where none is readable, those samples "
                     f"are lost to this drafter: train one on a new extraction of the run")


def _deleted_after(run: _Run, step: int) -> list[list[int]]:
    """The shards, as [first, last] runs, that this trainer's watermarks of steps after `step` name
    and whose consumed marker is there (their data deleted, or about to be)."""
    from layertap.manifests.consumption import consumed_shards, shard_runs, watermarks

    named = {s for m in watermarks(run.data).values()
             if m.get("output") == run.out.uri and m.get("run_id") in (None, run.stream.run_id) and m["step"] > step
             for a, b in m["ranges"] for s in range(a, b + 1)}
    return shard_runs(sorted(named & consumed_shards(run.data))) if named else []


def _delete_consumed(run: _Run, step: int) -> None:
    """--delete-consumed, once the checkpoint at `step` is committed: every rank records the shards
    it has read for the last time as of that checkpoint; then rank 0 deletes the data of those
    every rank has. Never loses data: a restart resumes from that checkpoint, which never needs
    them again."""
    from layertap.manifests.consumption import delete_consumed, record_consumed

    acc = run.acc
    # Looked up again, on rank 0, before the watermarks and before the deletion: a trainer that stalled
    # past the lease's ttl after its checkpoint's look wrote the watermarks of a step the trainer that
    # took over never reached, and deleted the data that one resumes on.
    if any(lost for (lost,) in per_rank(acc, [float(run.lease is not None and not run.lease.holds())])):
        raise taken_over(run.out)
    shards = run.stream.consumed_shards(run.batches.state_dict())
    record_consumed(run.data, rank=acc.process_index, world_size=acc.num_processes, shards=shards, step=step,
                    run_id=run.stream.run_id, output=run.out.uri)
    acc.wait_for_everyone()
    if acc.is_main_process:
        if run.lease is not None:
            run.lease.check()
        delete_consumed(run.data, run_id=run.stream.run_id)  # logs what it deleted
    acc.wait_for_everyone()


def _check_left_to_train(data: ObjectStore, run: Manifest) -> None:
    """A new follow trainer of a run whose every committed shard was consumed and deleted by a
    --delete-consumed trainer, and whose extraction is over (every shard committed, or the rest
    given up with no live lease: the follow watcher's test), has nothing to train on: it ran its
    steps on padding, reported a NaN loss and exported an untrained drafter, exiting 0."""
    from layertap.manifests import layout
    from layertap.manifests.consumption import consumed_shards
    from layertap.manifests.state import listed_shards
    from layertap.train.follow import pending_work

    committed = listed_shards(data, layout.COMMITS)
    if not committed or not committed <= consumed_shards(data):
        return
    given_up: list[int] = []
    if len(committed) < len(run.shards):
        if not (rest := pending_work(data, run, committed)).over:
            return  # extraction goes on: a trainer waits for what it commits
        given_up = rest.given_up
    lost = f" (extraction gave up shard(s) {listing(given_up)})" if given_up else ""
    raise InputError(f"every shard of {data.uri} was trained on and deleted by a --delete-consumed trainer{lost}: "
                     "nothing is left to train on. Extract the run again (to another --out) to train another "
                     "drafter on it")


def _check_consumer(cfg: TrainConfig, data: ObjectStore, output: str, rank: int, world: int, shard_bytes: int,
                    fresh: bool) -> None:
    """One --delete-consumed trainer per run (`consumption.claim_consumer`), whose start from step 0
    (`fresh`) voids the watermarks of an earlier one (`forget_watermarks`), and which is warned of
    a window its buffers and batches can fill (`window_shortfall`: the run would stall in a minute
    or so); another trainer of the same run is warned that shards may go while it reads them, and
    a follow trainer of a window run that none consumes, that the window will not open (`shard_bytes`:
    the run's largest planned shard). Before the first step: no rank has written a watermark of this start yet."""
    from layertap.manifests.consumption import (claim_consumer, consumer_of, forget_watermarks, recorded_window,
                                                window_shortfall)
    from layertap.storage.units import size

    if cfg.delete_consumed:
        claim_consumer(data, output)
        if fresh and rank == 0 and (gone := forget_watermarks(data)):
            log.info("removed %d consumption watermark(s) of an earlier start from %s: this trainer starts at step 0",
                     gone, data.uri)
        # the extraction records its window as its first worker starts: a trainer that starts first (as
        # `submit --train-while-extracting` queues it) is told by the stall check ("STALLED"), once it fills
        if rank == 0:
            try:  # a warning: a store that does not answer fails no start
                why = (window_shortfall(window, world, cfg.num_workers, cfg.shuffle_buffer, cfg.batch_size,
                                        shard_bytes, cfg.grad_accum)
                       if (window := recorded_window(data)) is not None else None)
            except UserError:
                why = None
            if why is not None:
                log.warning("%s: %s", data.uri, why)
    elif rank == 0 and cfg.follow and consumer_of(data) is None and (window := recorded_window(data)) is not None:
        log.warning("%s is extracted under a --window of %s, and no --delete-consumed trainer has claimed it: nothing "
                    "trained on is deleted, so once the data at rest fills the window, extraction and this trainer "
                    "wait for each other for good. Train with --delete-consumed (--resume continues this one), or "
                    "extract without --window", data.uri, size(window))
    elif rank == 0 and (holder := consumer_of(data)) not in (None, output):
        log.warning("%s is consumed by the --delete-consumed trainer writing to %s: shards it deletes are left out "
                    "of this run if gone at its start, and fail it if they go while it reads them", data.uri, holder)


def _check_resumable(state: dict[str, Any], cfg: TrainConfig, world: int) -> None:
    if state.get("world_size") != world:
        raise ConfigError(f"the checkpoint was written by {state.get('world_size')} rank(s), this run has {world}: "
                         "resume with the same number of processes (the data order depends on it)")
    # Mid-epoch the loader refuses another split (its position is per worker); at an epoch's end it may
    # change, but the epochs after are then drawn in another order than an uninterrupted run's. No
    # worker and one are one consumer each, the same order.
    if "num_workers" in state and max(1, state["num_workers"] or 0) != max(1, cfg.num_workers or 0):
        log.warning("--num-workers %s, the checkpoint's run had %s: the epochs from here are drawn in another order "
                    "than the uninterrupted run's (each sample still once an epoch, in as many batches as the "
                    "workers split it into); resume with --num-workers %s "
                    "to keep it", cfg.num_workers or 0, state["num_workers"] or 0, state["num_workers"] or 0)
    check_resume_settings(state, cfg)


def check_resume_settings(state: dict[str, Any], cfg: TrainConfig) -> None:
    """Refuse `cfg` a resume of the checkpoint whose state.json is `state` where their settings differ
    (what `submit train` checks too: a job refused in the queue left its extraction waiting)."""
    saved, now = {**RESUME_DEFAULTS, **state.get("config", {})}, cfg.identity()
    saved["data"], now["data"] = _store_uri(saved.get("data")), _store_uri(now.get("data"))  # as typed: `submit`'s
    diffs = [f"{k}: checkpoint {saved.get(k)!r}, now {now.get(k)!r}" for k in {**saved, **now}
             if k not in ("steps", "epochs") and saved.get(k) != now.get(k)]
    if diffs:
        anew = (" (its run, which this output's --delete-consumed trainer has claimed, is then out of reach: train "
                "anew on a new extraction)" if cfg.delete_consumed else "")
        raise ConfigError("cannot resume: settings differ from the checkpoint's: " + "; ".join(diffs) + ". Resume "
                          f"with the checkpoint's settings, or train anew into another --out than {cfg.out}{anew}")
    _check_drafter_flags(state["drafter"], cfg)


def _store_uri(uri: Any) -> Any:
    """`uri` as its store names it: checkpoints written before --data was recorded that way hold
    it as typed (`run1/`, a relative path), which must still resume with any spelling of it."""
    if not isinstance(uri, str):
        return uri
    try:
        return open_store(uri).uri
    except StoreError:  # not a store URI this version opens: compared as it is
        return uri


# Settings that shape the drafter, which a resume takes from the checkpoint: (TrainConfig field, DrafterConfig key).
_DRAFTER_FLAGS = (("drafter_layers", "num_layers"), ("mask_token_id", "mask_token_id"))


def _check_drafter_flags(drafter: dict[str, Any], cfg: TrainConfig) -> None:
    """A resume continues the checkpoint's drafter as it is, so a --drafter-layers or --mask-token-id
    asking for another was ignored without a word: refused. Left out (None), nothing is compared."""
    for name, key in _DRAFTER_FLAGS:
        given, saved = getattr(cfg, name), drafter.get(key)
        if given is not None and given != saved:
            flag = "--" + name.replace("_", "-")
            raise ConfigError(f"cannot resume: {flag} {given}, but the checkpoint's drafter has {key} {saved}, and a "
                              f"resumed run continues that drafter: leave out {flag} (or pass {flag} {saved}) to "
                              f"resume, or train a new drafter with {flag} {given} into another --out")


def _metrics_until(out, step: int) -> list[str]:
    from layertap.storage.store import ObjectNotFound

    try:
        text = out.get(METRICS).decode("utf-8", "replace")
    except ObjectNotFound:
        return []
    kept, dropped = [], 0
    for line in filter(None, text.splitlines()):
        try:
            record = json.loads(line)
            recorded = record["step"] if type(record) is dict and type(record.get("step")) is int else None
        except (ValueError, RecursionError):
            recorded = None
        if recorded is None:  # a line cut short by a kill, or damaged: a side file must not block the resume
            dropped += 1
        elif recorded <= step:
            kept.append(line)
    if dropped:
        log.warning("%s/%s: %d line(s) are no step record (cut short?): left out of the metrics", out.uri, METRICS,
                    dropped)
    return kept


def _progress(rank: int, start: int, total: int):
    """Rank 0's bar (logging above it), or a log line every 30 s when stderr is not a terminal."""
    from layertap.extract.console import progress

    return progress(total, initial=start, desc="train", unit="step", enabled=rank == 0)
