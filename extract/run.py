"""`layertap extract`: plan the run (or resume it), then extract shards until none is left.

One process per GPU (`accelerate launch`), or one process on CPU. Rank 0 plans: it tokenizes
the dataset once for token counts and writes the manifest; the other ranks wait for it. Every
rank then claims shards through leases, so ranks, nodes and Slurm array tasks can come and go.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from typing import Any

import torch

from extract.config import ExtractConfig
from extract.estimate import planned_bytes_per_token
from extract.inputs import Skipped, TokenizedSample, TokenizeStats, dataset_fingerprint, load_rows, tokenize_rows
from extract.model import Capture, Target, default_layers, load_target
from extract.pipeline import HostStaging, PipelineStats, extract_shard
from manifests import layout
from manifests.manifest import Manifest, NoRun, create_or_resume, load_manifest
from manifests.records import Producer
from manifests.state import scan
from manifests.status import run_status
from manifests.work import WorkQueue
from storage.shard import ShardMeta
from storage.store import ObjectStore, open_store

log = logging.getLogger("layertap.extract")


class Preempted(BaseException):
    """SIGTERM/SIGUSR1 from Slurm or a user: stop now, abort the open shard, release its lease."""


def _on_signal(signum, frame) -> None:
    # One stop is enough. Under Slurm the signal can come twice (to every process of the job, and
    # again through a launcher such as torchrun): a second one must not break off the cleanup.
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    raise Preempted(f"received {signal.Signals(signum).name}")


def extract(cfg: ExtractConfig) -> int:
    """Run extraction on this process's share of the run; 0 when the run is complete."""
    from accelerate import PartialState

    state = PartialState(cpu=not torch.cuda.is_available())
    _setup_logging(cfg.log_dir, state.process_index)
    previous = {sig: signal.signal(sig, _on_signal) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        return _extract(cfg, state)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _extract(cfg: ExtractConfig, state) -> int:
    rank, world = state.process_index, state.num_processes
    store = open_store(cfg.out, **cfg.s3) if cfg.out.startswith("s3://") else open_store(cfg.out)
    # A missing bucket, a wrong endpoint or no credentials fail here, not after minutes of loading
    # the model (a listing: a HEAD's 404 does not say whether the bucket exists).
    next(store.list(layout.MANIFEST), None)

    rows, fingerprint = dataset_rows(cfg)  # a bad dataset fails before the model loads
    target, capture, identity = prepare_target(cfg, state.device)

    manifest = _plan(store, cfg, identity, rows, fingerprint, target, rank)
    log.info("rank %d/%d: run %s at %s, %d shards", rank, world, manifest.run_id, store.uri, len(manifest.shards))

    producer = Producer.current(rank)
    queue = WorkQueue(store, manifest, producer, ttl_s=cfg.lease_ttl_s, shards=cfg.shards, retries=cfg.retries,
                      world_size=world)
    totals = PipelineStats()
    progress = Progress(rank, world, store, manifest)
    pad_id = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else 0
    committed = 0
    staging = HostStaging() if next(capture.decoder.parameters()).is_cuda else None  # pinned once, reused
    try:
        for claim in queue:
            try:
                plan = claim.plan
                with claim:
                    samples, skipped, truncated = _tokenize(rows, target, cfg, plan.start, plan.end)
                    meta = shard_meta(cfg, identity, manifest.run_id, plan.id)
                    info = extract_shard(
                        capture, samples, meta, store.open_writer(claim.data_key), batch_tokens=cfg.batch_tokens,
                        pad_id=pad_id, encode_threads=cfg.encode_threads, stats=totals,
                        should_stop=claim.lost.is_set, on_record=progress.record, staging=staging,
                    )
                    if claim.commit(info, skipped=skipped, truncated=truncated):
                        committed += 1
                        progress.committed(len(skipped))
                        log.info("shard %d committed: %d samples, %d tokens, %.1f MB (%d skipped, %d truncated)",
                                 plan.id, info.num_records, info.num_tokens, info.bytes / 1e6, len(skipped), truncated)
                    else:
                        progress.abandoned()  # another attempt's commit counts these samples
            except Preempted:
                claim.release()  # again: the signal may have cut the claim's own release short
                log.warning("preempted: shard %d aborted, its lease released", claim.shard)
                raise
            except Exception as e:  # recorded by the claim; go on with the next shard
                progress.abandoned()
                log.error("shard %d failed: %s: %s", claim.shard, type(e).__name__, e, exc_info=log.isEnabledFor(logging.DEBUG))
    except Preempted:
        progress.close()
        return 143
    progress.close()
    log.info("rank %d done: %d shards committed; %s", rank, committed, totals.to_json())
    if rank != 0:
        return 0
    return _summary(store, cfg)


def _setup_logging(log_dir: str, rank: int) -> None:
    """Full logs per rank in files; only rank 0 talks to the console (warnings from others)."""
    os.makedirs(log_dir, exist_ok=True)
    root = logging.getLogger()
    for h in [h for h in root.handlers if getattr(h, "_layertap", False)]:
        root.removeHandler(h)
        h.close()
    fh = logging.FileHandler(os.path.join(log_dir, f"extract-rank{rank}.log"))
    fh._layertap = True
    fh.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    fh.setLevel(logging.DEBUG)
    root.addHandler(fh)
    root.setLevel(min(root.getEffectiveLevel(), logging.INFO))  # INFO at least; DEBUG stays with -v
    if rank != 0:
        for h in root.handlers:
            if h is not fh:
                h.setLevel(logging.WARNING)


def prepare_target(cfg: ExtractConfig, device: str | torch.device = "cpu",
                   weights: bool = True) -> tuple[Target, Capture, dict[str, Any]]:
    """The target (cut, with capture hooks), and the run identity its manifest pins.

    The one place that resolves the embedded default model and the default layers, so that
    `layertap plan` (``weights=False``: a meta-device model) writes the very manifest that
    `layertap extract` resumes. Sets ``cfg.gguf_file`` when the embedded model is used.
    """
    model_path, gguf_file = cfg.model, cfg.gguf_file
    if model_path is None:
        from extract.embedded import smollm2_gguf

        model_path, gguf_file = smollm2_gguf()
        log.info("no --model given: using the embedded SmolLM2-135M-Instruct (%s)", gguf_file)
    target = load_target(model_path, gguf_file, dtype=getattr(torch, cfg.dtype),
                         attn_implementation=cfg.attn_implementation, device=device, weights=weights)
    layers = cfg.layers if cfg.layers is not None else default_layers(target.info["num_layers"])
    capture = Capture(target.model, layers, cfg.final_state)  # validates layers before any work
    cfg.gguf_file = gguf_file
    identity = cfg.identity(dict(target.info, model=cfg.model or f"embedded:{gguf_file}"), capture.layers)
    return target, capture, identity


def shard_meta(cfg: ExtractConfig, identity: dict[str, Any], run_id: str, shard_id: int) -> ShardMeta:
    """The HEAD metadata of one of the run's shards."""
    return ShardMeta(run_id=run_id, shard_id=shard_id, model=identity["model"],
                     model_revision=identity["model_revision"], layers=identity["layers"],
                     final_state=cfg.final_state, hidden_size=identity["hidden_size"],
                     codec=cfg.codec, tokenizer=identity["tokenizer"],
                     extra={"gguf_file": cfg.gguf_file, "max_length": cfg.max_length})


def dataset_rows(cfg: ExtractConfig):
    """The run's rows (a ``datasets.Dataset``) and the fingerprint its manifest pins."""
    if cfg.dataset is not None:
        return load_rows(cfg.dataset, cfg.limit), dataset_fingerprint(cfg.dataset, cfg.limit)
    import datasets

    from extract.embedded import sharegpt_conversations

    log.info("no --dataset given: using the first %d embedded ShareGPT conversations", cfg.limit)
    rows = datasets.Dataset.from_list(list(sharegpt_conversations(cfg.limit)))
    return rows, f"embedded:sharegpt_v3:limit={cfg.limit}"


def _tokenize(rows, target, cfg: ExtractConfig, start: int, end: int):
    """The samples of rows [start, end), plus the skipped ones with reasons."""
    stats = TokenizeStats()
    samples: list[TokenizedSample] = []
    skipped: list[dict[str, str]] = []
    for out in tokenize_rows(rows.select(range(start, end)), target.tokenizer, cfg.max_length, start=start,
                             vocab_size=target.info["vocab_size"], stats=stats):
        if isinstance(out, Skipped):
            skipped.append({"sample_id": out.sample_id, "reason": out.reason, "detail": out.detail})
        else:
            samples.append(out)
    return samples, skipped, stats.truncated


def plan_bytes_per_token(cfg: ExtractConfig, identity: dict[str, Any]) -> float:
    """Stored bytes per token the planner sizes shards with (the codec's expected ratio)."""
    return planned_bytes_per_token(capture_layers=len(identity["layers"]), final_state=cfg.final_state != "none",
                                   hidden_size=identity["hidden_size"], codec=cfg.codec)


def write_plan(store: ObjectStore, cfg: ExtractConfig, identity: dict[str, Any], fingerprint: str,
               counts: list[int] | None) -> tuple[Manifest, bool]:
    """The run's manifest, created from `counts` if there is none yet (see `create_or_resume`)."""
    dataset = {"fingerprint": fingerprint} if counts is None else {"fingerprint": fingerprint,
                                                                    "path": cfg.dataset or "embedded"}
    return create_or_resume(store, config=identity, dataset=dataset, token_counts=counts,
                            bytes_per_token=plan_bytes_per_token(cfg, identity), shard_bytes=cfg.shard_bytes)


def _plan(store: ObjectStore, cfg: ExtractConfig, identity: dict[str, Any], rows, fingerprint: str, target,
          rank: int) -> Manifest:
    """Rank 0 creates the manifest (or checks the existing one); other ranks wait for it."""
    if rank == 0:
        try:
            return write_plan(store, cfg, identity, fingerprint, None)[0]
        except NoRun:
            pass
        log.info("planning a new run: tokenizing %d rows for their token counts", len(rows))
        counts = [len(s) if isinstance(s, TokenizedSample) else 0
                  for s in tokenize_rows(rows, target.tokenizer, cfg.max_length, vocab_size=target.info["vocab_size"])]
        return write_plan(store, cfg, identity, fingerprint, counts)[0]
    deadline = time.time() + 6 * 3600
    while True:
        try:
            return write_plan(store, cfg, identity, fingerprint, None)[0]
        except NoRun:
            if time.time() > deadline:
                raise
            time.sleep(0.5)


class Progress:
    """A bar on rank 0 over the run's samples: samples/s, tokens/s, MB/s stored, ratio, ETA.

    With several ranks, rank 0 counts its own records as they are written and, every
    `SYNC_S` seconds, everyone's committed samples from one listing of the tally markers.
    """

    SYNC_S = 30.0

    def __init__(self, rank: int, world: int, store: ObjectStore, manifest: Manifest):
        from tqdm import tqdm

        self.bar, self.world, self.store = None, world, store
        self.t0 = self.synced = time.time()
        self.tokens = self.stored = self.raw = self.in_shard = 0
        if rank == 0:
            self.bar = tqdm(total=manifest.num_samples, initial=self._committed(), unit="sample", desc="extract",
                            file=sys.stderr, dynamic_ncols=True, mininterval=1.0)

    def _committed(self) -> int:
        """Samples stored or skipped by committed shards, from the tally listing (no GETs)."""
        total = 0
        for o in self.store.list(layout.TALLY):
            parsed = layout.parse_tally(o.key)
            if parsed:
                total += parsed[1]["records"] + parsed[1]["skipped"]
        return total

    def record(self, rec) -> None:
        if self.bar is None:
            return
        self.tokens += rec.num_tokens
        self.stored += rec.size
        self.raw += rec.raw_bytes
        self.in_shard += 1
        dt = max(time.time() - self.t0, 1e-6)
        who = "rank 0: " if self.world > 1 else ""
        self.bar.set_postfix_str(f"{who}{self.tokens / dt:,.0f} tok/s, {self.stored / dt / 1e6:.1f} MB/s, "
                                 f"ratio {self.raw / max(self.stored, 1):.2f}x", refresh=False)
        self.bar.update(1)
        if self.world > 1 and time.time() - self.synced > self.SYNC_S:
            self.synced = time.time()
            self.bar.n = max(self.bar.n, self._committed() + self.in_shard)
            self.bar.refresh()

    def committed(self, skipped: int) -> None:
        if self.bar is not None:
            self.in_shard = 0
            self.bar.update(skipped)

    def abandoned(self) -> None:
        """The current shard failed: its records will be written again."""
        if self.bar is not None:
            self.bar.n -= self.in_shard
            self.in_shard = 0
            self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _unfinished(store: ObjectStore, shards: list[int]) -> list[int]:
    committed = scan(store, load_manifest(store)).committed
    return [s for s in shards if s not in committed]


def _summary(store: ObjectStore, cfg: ExtractConfig) -> int:
    from manifests.cli import format_status

    status = run_status(store)
    print(f"\nshards are in {store.uri}/shards/ (committed ones listed under {store.uri}/commits/)")
    print(format_status(status))
    if not status["complete"]:
        if cfg.shards is not None and not _unfinished(store, cfg.shards):
            # A static assignment (one Slurm array task's range) answers for its own shards only.
            print(f"\nthe {len(cfg.shards)} shard(s) of --shards are done; the rest of the run is other workers' part")
            return 0
        print("\nthe run is not complete: run the same command again to retry failed and pending shards")
        return 1
    print(f"\ntrain a drafter on it (the target is the one this run's manifest records):"
          f"\n  layertap train --data {cfg.out} --out {cfg.out.rstrip('/')}-drafter")
    return 0
