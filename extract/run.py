"""`layertap extract`: plan the run (or resume it), then extract shards until none is left.

One process per GPU (`accelerate launch`), or one process on CPU. Rank 0 plans: it tokenizes
the dataset once for token counts and writes the manifest; the other ranks wait for it. Every
rank then claims shards through leases, so ranks, nodes and Slurm array tasks can come and go.
The weights load only once there is work: the model's config and tokenizer are enough to plan,
to check a rerun against the run, and to find that every shard is already committed.
"""

from __future__ import annotations

import faulthandler
import logging
import math
import os
import shlex
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from layertap.extract.config import ExtractConfig, as_run_recorded, resolve_dtype
from layertap.extract.console import pause, progress, quiet_library_bars
from layertap.extract.estimate import fmt_bytes, planned_bytes_per_token
from layertap.extract.kernels import provenance
from layertap.extract.dataset_files import recorded_path
from layertap.extract.inputs import Skipped, TokenizedSample, TokenizeStats, load_pinned_rows, tokenize_rows
from layertap.extract.measure import require_samples, token_statistics
from layertap.extract.model import Capture, Target, default_layers, load_target, padding_id
from layertap.extract.pipeline import HostStaging, PipelineStats, start_shard
from layertap.extract.regenerated import pinned_template, template_kwargs
from layertap.extract.worker import ShardLoop, Started
from layertap.manifests import layout
from layertap.manifests.consumption import AtRest, WindowGate, forget_window
from layertap.manifests.manifest import (ConfigMismatch, Manifest, NoRun, create_or_resume, load_manifest,
                                          plan_shards, refuse_new_run_here)
from layertap.manifests.preemption import Interrupted, Preempted, StopSignals
from layertap.manifests.records import Producer
from layertap.manifests.state import feed_since, scan
from layertap.manifests.status import run_status
from layertap.manifests.work import Claim, WorkQueue, check_shard_ids, patiently
from layertap.storage.foreign import unservable_layer
from layertap.storage.errors import ConfigError, UserError
from layertap.storage.format import ShardMeta
from layertap.storage.identity import RunConfig
from layertap.storage.retry import Backoff
from layertap.storage.store import ObjectStore, StoreError, open_configured_store
from layertap.storage.units import counted, duration, listing, size

log = logging.getLogger("layertap.extract")
T = TypeVar("T")
EXIT_STALLED = 6  # a worker taken for hung (--stall-timeout); docs/SLURM.md lists the exit codes


def extract(cfg: ExtractConfig) -> int:
    """Run extraction on this process's share of the run; 0 when the run is complete."""
    from accelerate import PartialState

    state = PartialState(cpu=not torch.cuda.is_available())
    _setup_logging(cfg.log_dir, state.process_index)
    quiet_library_bars()
    at_stop = AtStop()
    with StopSignals(at_once=True) as stops:
        try:
            return _extract(cfg, state, stops, at_stop)
        except Preempted as e:
            _stopped(e, state.process_index, at_stop)
            return e.exit_code


@dataclass
class AtStop:
    """The shards this process had open when a stop came: those it released (back to the run for
    any worker), and those whose last forward was under way, which finished and committed."""

    released: list[int] = field(default_factory=list)
    finished: list[int] = field(default_factory=list)


def _stopped(e: Preempted, rank: int, at_stop: AtStop) -> None:
    """Say how the run goes on: committed shards are kept, the shards this process had open went
    back to the run, or committed (on a CPU a shard is often one forward: it ends, then the stop)."""
    released = at_stop.released
    open_ones = "; ".join(
        ([f"shard(s) {listing(sorted(released))} in progress released"] if released else [])
        + ([f"shard(s) {listing(sorted(at_stop.finished))} in their last forward when it came finished and "
            "committed"] if at_stop.finished else [])) or "no shard was in progress here"
    log.warning("stopped (%s: %s); committed shards are kept, %s", type(e).__name__, e, open_ones)
    if rank == 0 and isinstance(e, Interrupted):
        argv = sys.argv[1:]
        again = f":\n  layertap {shlex.join(argv)}" if "extract" in argv else ""
        then = "resume" if released else "go on from where the run is (it does nothing if the run is complete)"
        print(f"\ninterrupted: committed shards are kept, {open_ones}; run the same command again to {then}{again}",
              file=sys.stderr)


def _extract(cfg: ExtractConfig, state, stops: StopSignals | None = None, at_stop: AtStop | None = None) -> int:
    """`extract`'s work; what became of the shards it had open at a stop goes to `at_stop`."""
    at_stop = at_stop if at_stop is not None else AtStop()
    rank, world = state.process_index, state.num_processes
    stops = stops if stops is not None else StopSignals(at_once=True)  # not entered: no stop comes
    store = open_configured_store(cfg.out, cfg.s3)
    # A missing bucket, a wrong endpoint or no credentials fail here, not after minutes of loading
    # the model (a listing: a HEAD's 404 does not say whether the bucket exists). Not patiently:
    # an endpoint that never answered is a wrong URL; after this, a failing store is an outage.
    rerun = any(o.key == layout.MANIFEST for o in store.list(layout.MANIFEST))

    rows, fingerprint = dataset_rows(cfg)  # a bad dataset fails before the model loads
    target: Target | None = None
    if rerun:
        # The model's config and tokenizer are enough to check this configuration against the run
        # and to find its shards committed: the weights load only if there is work left, so that
        # a rerun of a finished run answers in seconds.
        _, _, identity = prepare_target(cfg, weights=False)
        manifest, identity = _patiently(lambda: resume_run(store, cfg, identity, fingerprint))
    else:
        if rank == 0:  # create_or_resume refuses it too, but only after the weights load and the dataset is tokenized
            _patiently(lambda: refuse_new_run_here(store))
        target, capture, identity = prepare_target(cfg, state.device)
        loaded_as = cfg.dtype
        manifest, identity = _plan(store, cfg, identity, rows, fingerprint, target) if rank == 0 \
            else _wait_for_plan(store, cfg, identity, fingerprint)
        if cfg.dtype != loaded_as:  # another job planned the run meanwhile, pinning a dtype its workers all keep
            target = capture = None  # loaded again below, in it
    log.info("rank %d/%d: run %s at %s, %s", rank, world, manifest.run_id, store.uri,
             counted(len(manifest.shards), "shard"))

    producer = Producer.current(rank)
    # The storage window: before each claim, wait while too much committed data awaits training.
    gate = WindowGate(store, cfg.window, producer=producer, shards=cfg.shards) if cfg.window is not None else None
    if gate is None and rank == 0:
        # an earlier --window extraction's record would tell trainers of a window
        _patiently(lambda: forget_window(store))
    if gate is not None and rank == 0 and cfg.window < 2 * manifest.largest_shard_bytes:
        log.warning("--window %s holds fewer than two of this run's shards (~%s the largest): every claim waits until "
                    "training has consumed what is at rest, one shard at a time, and a trainer whose shuffle buffer "
                    "needs more samples than a shard holds stalls for good (`layertap submit extract "
                    "--train-while-extracting` names the window its trainer needs)", size(cfg.window),
                    size(manifest.largest_shard_bytes))
    queue = WorkQueue(store, manifest, producer, ttl_s=cfg.lease_ttl_s, shards=cfg.shards, retries=cfg.retries,
                      world_size=world, before_claim=gate, stopped_for=stops.stopped_for,
                      stall_s=cfg.stall_timeout_s, on_stall=exit_stalled)
    if queue.finished():
        log.info("nothing to do: %s committed", "every shard of the run is" if cfg.shards is None
                 else f"each of the {len(queue.candidates)} shard(s) of --shards is")
        return _summary(store, cfg, queue) if rank == 0 else 0
    if target is None:  # a rerun's weights, or another dtype's: its capture layers were warned of
        target, capture, _ = prepare_target(cfg, state.device, warn_layers=False)
    totals = PipelineStats()
    pad_id = padding_id(target)
    staging = HostStaging() if next(capture.decoder.parameters()).is_cuda else None  # pinned once, reused
    told: set[str] = set()  # the skip reasons this worker has shown an example of

    def start(claim: Claim, counted) -> Started:
        plan = claim.plan
        samples, skipped, truncated = _tokenize(rows, target, cfg, plan.start, plan.end, told)
        meta = shard_meta(cfg, identity, manifest.run_id, plan.id, target.info["dtype"], provenance(target.model))

        def on_record(rec) -> None:
            queue.progress()
            counted(rec)
            progress.record(plan.id, rec)

        def should_stop() -> bool:
            stops.raise_if_requested()  # a stop signal: the shard is aborted at this batch boundary
            return claim.lost.is_set()

        tail = start_shard(capture, samples, meta, store.open_writer(claim.data_key), batch_tokens=cfg.batch_tokens,
                           pad_id=pad_id, encode_threads=cfg.encode_threads, stats=totals,
                           should_stop=should_stop, on_record=on_record, staging=staging)
        return Started(tail, skipped, truncated)

    # the last shard's end (committed or abandoned), for the summary's rate: not the wait after it for others' shards
    last_end: float | None = None

    def _abandoned(shard: int) -> None:
        nonlocal last_end
        last_end = time.perf_counter()
        progress.abandoned(shard)
        if stops.stopped_for() is not None:  # released at a stop (not failed)
            at_stop.released.append(shard)

    def _committed(claim: Claim, info, skipped) -> None:
        nonlocal last_end
        last_end = time.perf_counter()
        progress.committed(claim.plan.id, info.num_records, skipped)
        if stops.stopped_for() is not None:  # its last forward was under way at the stop
            at_stop.finished.append(claim.plan.id)

    t_start = time.perf_counter()
    with Progress(rank, world, store, manifest, cfg.shards) as progress:
        if gate:
            gate.on_wait = progress.waiting
        # auto: overlapped on a GPU, where the tail's CPU work and requests run beside the device's
        # forward; in turn on CPU, where they would take the forward's cores (measured on 2 cores:
        # 1.09x slower overlapped, docs/benchmarks.md "Shards in turn or overlapped").
        overlap = gate is None and (cfg.overlap_shards == "on" or cfg.overlap_shards == "auto" and staging is not None)
        loop = ShardLoop(start, overlap=overlap,
                         committed=_committed,
                         abandoned=lambda claim, records: _abandoned(claim.plan.id), stops=stops)
        queue.on_idle = loop.settle
        try:
            committed = loop.run(queue)
        finally:
            totals.add(wall_s=(time.perf_counter() if last_end is None else last_end) - t_start)
    log.info("rank %d done: %d shard(s) committed", rank, committed)
    for line in summary_lines(totals):
        log.info("  %s", line)
    if rank != 0:
        return 0
    return _summary(store, cfg, queue)


def exit_stalled(seconds: float, shard: int) -> None:
    """A hung worker's end (`WorkQueue.stalled`): every thread's stack to its log file and stderr,
    where the stuck one shows what it waits in, then an exit at once: its main thread is in a call
    no exception reaches, and only the process's end ends its job, frees its GPU and lets a worker
    on this machine take its shards over without waiting for their leases to go stale."""
    log.error("exiting %d: every thread's stack follows (the stuck one shows where it waits). The same command "
              "goes on from where the run is; a worker that hangs again on this node may have a faulty GPU "
              "(look for Xid errors in `dmesg`, `nvidia-smi -q`)", EXIT_STALLED)
    handlers = logging.getLogger().handlers
    for h in handlers:
        h.flush()
    for stream in [sys.stderr, *(h.stream for h in handlers if isinstance(h, logging.FileHandler))]:
        try:
            faulthandler.dump_traceback(file=stream, all_threads=True)
        except (ValueError, OSError, AttributeError):  # a stream without a file descriptor (a captured stderr)
            pass
    os._exit(EXIT_STALLED)


def summary_lines(stats: PipelineStats) -> list[str]:
    """What a worker extracted and where its time went, with units, for the log."""
    if not stats.samples:
        return []
    wall = max(stats.wall_s, 1e-9)
    pad = stats.padded_tokens / max(stats.tokens, 1) - 1
    return [
        f"{stats.samples:,} samples, {stats.tokens:,} tokens (+{100 * pad:.0f}% padding in batches), "
        f"{fmt_bytes(stats.raw_bytes)} of states stored as {fmt_bytes(stats.stored_bytes)} "
        f"({stats.raw_bytes / max(stats.stored_bytes, 1):.2f}x)",
        f"{wall:,.1f} s{f' ({duration(wall)})' if wall >= 90 else ''} from the start to the last shard's end, "
        f"{stats.tokens / wall:,.0f} tokens/s, {stats.stored_bytes / wall / 2**20:.1f} MiB/s "
        f"stored: forward {stats.forward_s:.1f} s, host copy {stats.copy_s:.1f} s, encode {stats.encode_s:.1f} s "
        f"(CPU, summed over threads), write {stats.write_s:.1f} s, shard close {stats.close_s:.1f} s",
    ]


def _setup_logging(log_dir: str, rank: int) -> None:
    """Full logs per rank in files; only rank 0 talks to the console (warnings from others)."""
    path = os.path.join(log_dir, f"extract-rank{rank}.log")
    try:
        os.makedirs(log_dir, exist_ok=True)
        fh = logging.FileHandler(path)
    except OSError as e:  # the default ./layertap-logs of a job started in a read-only checkout
        raise ConfigError(f"cannot write the log file {path}: {e.strerror or e}; give --log-dir a folder this "
                          "process can write") from None
    root = logging.getLogger()
    for h in [h for h in root.handlers if getattr(h, "_layertap", False)]:
        root.removeHandler(h)
        h.close()
    fh._layertap = True
    fh.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    fh.setLevel(logging.DEBUG)
    root.addHandler(fh)
    root.setLevel(min(root.getEffectiveLevel(), logging.INFO))  # INFO at least; DEBUG stays with -v
    if rank != 0:
        for h in root.handlers:
            if h is not fh:
                h.setLevel(logging.WARNING)


def prepare_target(cfg: ExtractConfig, device: str | torch.device = "cpu", weights: bool = True,
                   warn_layers: bool = True) -> tuple[Target, Capture, RunConfig]:
    """The target (cut, with capture hooks), and the run identity its manifest pins.

    The one place that resolves the embedded default model, a local model folder (to its real
    path: the same folder however it is named) and the default layers, so that `layertap plan`
    (``weights=False``: a meta-device model, from the config and tokenizer alone) writes the very
    manifest that `layertap extract` resumes. Sets ``cfg.gguf_file`` when the embedded model is used.
    ``warn_layers=False``: the capture layers were warned of already (the weights of a rerun load
    after its model's config was checked).
    """
    model_path, gguf_file = cfg.model, cfg.gguf_file
    if model_path is None:
        from layertap.extract.embedded import smollm2_gguf

        model_path, gguf_file = smollm2_gguf()
        if cfg.gguf_file not in (None, gguf_file):  # not in silence: the user asked for another model
            raise ConfigError(f"--gguf-file {cfg.gguf_file!r} needs --model (the folder or hub id holding it)")
        if cfg.gguf_file != gguf_file:  # said once, not again when the weights follow
            log.info("no --model given: using the embedded SmolLM2-135M-Instruct (%s)", gguf_file)
    elif os.path.exists(model_path):
        model_path = os.path.realpath(model_path)
    embedded = cfg.model is None or _is_embedded(model_path, gguf_file)
    dtype, why = resolve_dtype(cfg.dtype, device)
    if weights:
        log.info("forward dtype %s (%s); states are stored as bf16", dtype, why)
    target = load_target(model_path, gguf_file, dtype=getattr(torch, dtype),
                         attn_implementation=cfg.attn_implementation, device=device, weights=weights,
                         chat_template_kwargs=cfg.chat_template_kwargs)
    layers = cfg.layers if cfg.layers is not None else default_layers(target.info["num_layers"])
    capture = Capture(target.model, layers, cfg.final_state)  # validates layers before any work
    if weights:  # once per extraction, as the states are about to be computed
        _warn_past_context(cfg.max_length, capture.decoder.config)
    if warn_layers and (why := unservable_layer(capture.layers, capture.num_layers)) is not None:
        log.warning(why)
    cfg.gguf_file = gguf_file
    identity = cfg.identity(dict(target.info, model=f"embedded:{gguf_file}" if embedded else model_path),
                            capture.layers)
    return target, capture, identity


def _is_embedded(model_path: str, gguf_file: str | None) -> bool:
    """Whether --model and --gguf-file name the embedded SmolLM2 by its folder: the run is the
    default model's (`embedded:...`), and resumes one made without --model."""
    from layertap.extract.embedded import smollm2_gguf

    try:
        folder, name = smollm2_gguf()
    except (ModuleNotFoundError, UserError):  # not installed: it cannot be this
        return False
    return gguf_file == name and os.path.realpath(folder) == model_path


def _warn_past_context(max_length: int, config: Any) -> None:
    """Warn when --max-length lets samples run past the context the model was trained on: their
    states past it are the model's extrapolation, not what it serves, and a drafter trained on
    them learns from those. A warning, not a refusal: some models serve past their config's value
    (RoPE scaling) and most samples may be shorter anyway."""
    trained = getattr(config, "max_position_embeddings", None)
    if isinstance(trained, int) and max_length > trained:
        log.warning("--max-length %d is above the model's max_position_embeddings %d: samples longer than %d "
                    "tokens are stored with states past the context it was trained on; lower --max-length to %d "
                    "unless the model is known to serve longer contexts", max_length, trained, trained, trained)


def shard_meta(cfg: ExtractConfig, identity: RunConfig, run_id: str, shard_id: int,
               forward_dtype: str | None = None, produced_by: dict[str, Any] | None = None) -> ShardMeta:
    """The HEAD metadata of one of the run's shards (`extra.forward_dtype`: the dtype its states
    were computed in, which an "auto" run chooses per worker; `extra.produced_by`: the device,
    kernels and package versions that computed them, extract/kernels.py's `provenance`)."""
    extra = {"gguf_file": cfg.gguf_file, "max_length": cfg.max_length, "forward_dtype": forward_dtype}
    if produced_by is not None:
        extra["produced_by"] = produced_by
    return ShardMeta.of(identity, run_id=run_id, shard_id=shard_id, extra=extra)


def dataset_rows(cfg: ExtractConfig):
    """The run's rows (a ``datasets.Dataset``) and the fingerprint its manifest pins; and
    `cfg.chat_template_kwargs` resolved (`template_kwargs`: a regenerated dataset's own where none
    is given, None for none), before the model loads."""
    cfg.chat_template_kwargs = template_kwargs(cfg.dataset, cfg.chat_template_kwargs, cfg.s3)
    if cfg.dataset is not None:
        return load_pinned_rows(cfg.dataset, cfg.limit, cfg.s3)
    import datasets

    from layertap.extract.embedded import sharegpt_conversations

    log.info("no --dataset given: using the first %d embedded ShareGPT conversations", cfg.limit)
    rows = datasets.Dataset.from_list(list(sharegpt_conversations(cfg.limit)))
    return rows, f"embedded:sharegpt_v3:limit={cfg.limit}"


def _tokenize(rows, target, cfg: ExtractConfig, start: int, end: int, told: set[str]):
    """The samples of rows [start, end), plus the skipped ones with reasons (the first of each
    reason not in `told` logged, and added to it)."""
    stats = TokenizeStats()
    samples: list[TokenizedSample] = []
    skipped: list[dict[str, str]] = []
    for out in tokenize_rows(rows.select(range(start, end)), target.tokenizer, cfg.max_length, start=start,
                             vocab_size=target.info["vocab_size"], stats=stats,
                             chat_template_kwargs=cfg.chat_template_kwargs):
        if isinstance(out, Skipped):
            skipped.append({"sample_id": out.sample_id, "reason": out.reason, "detail": out.detail})
            if out.reason not in told:  # counts alone ("template_error: 1") do not say what to fix
                told.add(out.reason)
                log.warning("sample %s skipped (%s): %s. Later samples skipped for it are counted in `layertap "
                            "status`, each with its detail in its shard's commit record (commits/)",
                            out.sample_id, out.reason, out.detail)
        else:
            samples.append(out)
    return samples, skipped, stats.truncated


def plan_bytes_per_token(cfg: ExtractConfig, identity: RunConfig) -> float:
    """Stored bytes per token the planner sizes shards with (the codec's expected ratio)."""
    return planned_bytes_per_token(capture_layers=len(identity.layers), final_state=identity.final_state != "none",
                                   hidden_size=identity.hidden_size, codec=identity.codec)


def write_plan(store: ObjectStore, cfg: ExtractConfig, identity: RunConfig, fingerprint: str,
               counts: list[int] | None, existing: Manifest | None = None) -> tuple[Manifest, bool]:
    """The run's manifest, created from `counts` if there is none yet (see `create_or_resume`;
    `existing`: the run's manifest, if the caller read it already)."""
    path = recorded_path(cfg.dataset) if cfg.dataset else None
    dataset = {"fingerprint": fingerprint} if counts is None else {"fingerprint": fingerprint,
                                                                    "path": path or "embedded", "limit": cfg.limit}
    dataset.update(pinned_template(cfg, existing))
    return create_or_resume(store, config=identity, dataset=dataset, token_counts=counts,
                            bytes_per_token=plan_bytes_per_token(cfg, identity), shard_bytes=cfg.shard_bytes,
                            existing=existing)


def resume_run(store: ObjectStore, cfg: ExtractConfig, identity: RunConfig,
            fingerprint: str) -> tuple[Manifest, RunConfig]:
    """The run at the prefix, if this configuration is its (`ConfigMismatch` if not, `NoRun` if
    there is none), and the identity in the run's own terms (`as_run_recorded`): with
    `--dtype auto`, a run that pinned a dtype keeps it."""
    run = load_manifest(store)
    identity = RunConfig.from_json(as_run_recorded(run.config, identity.to_json()))
    if cfg.dtype == "auto" and identity.dtype in ("bfloat16", "float32"):
        log.info("forward dtype %s: the run at %s was made with --dtype %s", identity.dtype, store.uri, identity.dtype)
        cfg.dtype = identity.dtype
    return write_plan(store, cfg, identity, fingerprint, None, existing=run)[0], identity  # one GET of the manifest


def _plan(store: ObjectStore, cfg: ExtractConfig, identity: RunConfig, rows, fingerprint: str,
          target: Target) -> tuple[Manifest, RunConfig]:
    """Rank 0's: the run's manifest, planned now (the dataset tokenized for its token counts)
    unless another job planned it meanwhile."""
    try:
        return _patiently(lambda: resume_run(store, cfg, identity, fingerprint))
    except NoRun:
        pass
    log.info("planning a new run: tokenizing %d rows for their token counts", len(rows))
    stats = token_statistics(rows, target.tokenizer, cfg.max_length, vocab_size=target.info["vocab_size"],
                             chat_template_kwargs=cfg.chat_template_kwargs)
    require_samples(stats)
    log.info("%s", stats.describe(cfg.dataset or "the embedded ShareGPT conversations"))
    if cfg.shards is not None:  # before the manifest is written: bad input leaves a new output empty
        check_shard_ids(cfg.shards, len(plan_shards(stats.counts, plan_bytes_per_token(cfg, identity),
                                                    cfg.shard_bytes)))
    try:
        return _patiently(lambda: write_plan(store, cfg, identity, fingerprint, stats.counts))[0], identity
    except ConfigMismatch:  # another job planned the run meanwhile: compared in the run's own terms, as at a resume
        return _patiently(lambda: resume_run(store, cfg, identity, fingerprint))  # (--dtype auto adopts its dtype)


def _wait_for_plan(store: ObjectStore, cfg: ExtractConfig, identity: RunConfig,
                   fingerprint: str) -> tuple[Manifest, RunConfig]:
    """The other ranks': the manifest rank 0 is writing. Polled with a growing, jittered pause
    (0.5 s up to 10 s): rank 0 may tokenize for many minutes, and 1,000 ranks polling every 0.5 s
    asked the store ~2,000 times a second meanwhile."""
    deadline = time.time() + 6 * 3600
    backoff = Backoff(0.5, 10.0, jitter=0.25)
    while True:
        try:
            return _patiently(lambda: resume_run(store, cfg, identity, fingerprint))
        except NoRun:
            if time.time() > deadline:
                raise
            backoff.sleep()


def _patiently(look: Callable[[], T]) -> T:
    """`look` at the store, riding out an outage as the work queue does (`work.patiently`): a store
    failing past its own retries while a worker starts (its plan, its resume) ended it with exit 2,
    the bad-input code, which under `srun --kill-on-bad-exit` ends the node's other workers too,
    when the same outage after its first commit was ridden out. Pauses 1 s growing to 30 s
    (jittered). Only once the endpoint has answered (`_extract`'s first listing): a wrong URL
    fails within seconds."""
    return patiently(look, Backoff(1.0, 30.0, jitter=0.25).next_pause)


def _consumer(store: ObjectStore) -> str | None:
    """The output of the run's --delete-consumed trainer, where one has claimed it (None: none, or unreadable)."""
    from layertap.manifests.consumption import consumer_of
    from layertap.manifests.manifest import ManifestError

    try:
        return consumer_of(store)
    except ManifestError:
        return None


def _all_committed(store: ObjectStore, manifest: Manifest, shards: list[int]) -> bool:
    """Whether every one of `shards` is committed: one scan of the run, which also refuses a run
    whose manifest was replaced."""
    st = scan(store, manifest)
    st.raise_if_replaced(store.uri)
    return all(s in st.committed for s in shards)


class Progress:
    """Rank 0's progress over the run's rows (those of --shards, when given): rows/s,
    tokens/s, MiB/s stored, ratio, ETA (a bar on a terminal, a log line every 30 s otherwise; see
    `extract.console`).

    Rank 0 counts its own records as they are written and, where others work the same samples
    (other ranks, or other processes taking the run's free shards: one-process array tasks),
    every `SYNC_S` seconds everyone's committed samples, on a thread of its own: the shards'
    writer threads, which report records, never wait on it, and a listing that fails only leaves
    the count behind (with a warning). The bar is a sum by shard, never an increment: a shard is
    counted from its records while rank 0 writes it, and at its plan's samples once committed,
    whoever saw the commit first (its own report or a listing), so no shard counts twice. The
    first look lists the commit records; later ones the feed keys written since
    (`layout.feed_after`: at 150,000 shards and 1,000 tasks, full listings every 30 s were ~5,000
    LIST requests a second), and the commit records again every `COMMITS_LOOK_S` (a shard whose
    feed key never landed: its worker killed after its commit, or the PUT failed).
    """

    SYNC_S = 30.0
    COMMITS_LOOK_S = 300.0

    def __init__(self, rank: int, world: int, store: ObjectStore, manifest: Manifest,
                 shards: list[int] | None = None):
        self.on, self.world, self.store = rank == 0, world, store
        # --shards (an array task's share): its samples, not the run's, make the total and the ETA
        self.only = None if shards is None else set(shards)
        total = sum(p.num_samples for p in manifest.shards if self.only is None or p.id in self.only)
        self.t0 = time.time()
        self.tokens = self.stored = self.raw = 0
        self._lock = threading.Lock()  # the writers of two shards report at once
        self._closed = threading.Event()
        self._listing_failed = False
        self._planned = {p.id: p.num_samples for p in manifest.shards}
        self._open: dict[int, int] = {}  # shard rank 0 writes -> its records so far
        self._counted: dict[int, int] = {}  # committed shard -> its samples stored or skipped
        self._feed_from: float | None = None  # the store's time the next look lists feed keys from
        self._commits_looked = -math.inf  # the store's time of the last listing of every commit record
        if self.on:
            self._committed()
        # rows (a plan's samples to store and those it skips alike): the run's "samples" count only the stored
        self.bar = progress(total, initial=self._done(), desc="extract", unit="row", enabled=self.on)
        if self.on and (world > 1 or self.only is None):
            threading.Thread(target=self._sync, name="progress-sync", daemon=True).start()

    def _done(self) -> int:
        """Samples done: committed shards' and those rank 0 has written of its open ones."""
        return sum(self._counted.values()) + sum(n for s, n in self._open.items() if s not in self._counted)

    def _committed(self) -> bool:
        """Count the shards committed since the last look, from listings alone (no GETs); False if
        the store could not list them."""
        try:
            started = self.store.now()
            seen: list[tuple[int, tuple[int, int] | None]] = []
            if started - self._commits_looked >= self.COMMITS_LOOK_S:
                # a commit covers its plan's samples exactly (`fits_plan`): the key alone counts it
                seen += [(shard, None) for o in self.store.list(layout.COMMITS)
                         if (shard := layout.shard_of(o.key, layout.COMMITS)) is not None]
                self._commits_looked = started
            if self._feed_from is not None:
                seen += [(shard, counts) for _, shard, counts in feed_since(self.store, self._feed_from)]
            self._feed_from = started - layout.FEED_MARGIN_S
        except StoreError as e:  # said once while it lasts, not every SYNC_S
            (log.debug if self._listing_failed else log.warning)(
                "progress: could not list the committed shards (%s); the count of other ranks' samples "
                "waits for the next listing", e)
            self._listing_failed = True
            return False
        self._listing_failed = False
        with self._lock:
            for shard, counts in seen:
                self._count(shard, counts)
        return True

    def _count(self, shard: int, counts: tuple[int, int] | None) -> None:
        """A committed shard's samples, once (a feed key written before keys held counts: its plan's)."""
        if shard not in self._counted and shard in self._planned and (self.only is None or shard in self.only):
            self._counted[shard] = sum(counts) if counts is not None else self._planned[shard]

    def _show(self) -> None:
        self.bar.n = self._done()
        self.bar.refresh()

    def _sync(self) -> None:
        while not self._closed.wait(self.SYNC_S):
            if self._committed():
                with self._lock:
                    if not self._closed.is_set():
                        self._show()

    def record(self, shard: int, rec) -> None:
        """A record of `shard` written (by this process: rank 0)."""
        if not self.on:
            return
        with self._lock:
            self.tokens += rec.num_tokens
            self.stored += rec.size
            self.raw += rec.raw_bytes
            self._open[shard] = self._open.get(shard, 0) + 1
            dt = max(time.time() - self.t0, 1e-6)
            who = "rank 0: " if self.world > 1 else ""
            self.bar.set_postfix_str(f"{who}{self.tokens / dt:,.0f} tok/s, {self.stored / dt / 2**20:.1f} MiB/s, "
                                     f"ratio {self.raw / max(self.stored, 1):.2f}x", refresh=False)
            self.bar.n = self._done()
            self.bar.update(0)  # refreshes at tqdm's own pace, as update(1) did

    def waiting(self, rest: AtRest | None) -> None:
        """The storage window is full (`rest`: what is at rest), or open again (None): shown on the progress line."""
        if self.on:
            pause(self.bar, rest is not None)
            self.bar.set_postfix_str(f"waiting: window full, {size(rest.bytes)} not yet consumed by training"
                                     if rest else "", refresh=False)
            self.bar.refresh()

    def committed(self, shard: int, records: int, skipped: int) -> None:
        """`shard` committed with `records` and `skipped` samples (unless a listing counted it first)."""
        if self.on:
            with self._lock:
                self._open.pop(shard, None)
                self._count(shard, (records, skipped))
                self._show()

    def abandoned(self, shard: int) -> None:
        """`shard` failed after some records were written: they will be written again."""
        if self.on:
            with self._lock:
                self._open.pop(shard, None)
                self._show()

    def close(self) -> None:
        with self._lock:
            self._closed.set()
            self.bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _summary(store: ObjectStore, cfg: ExtractConfig, queue: WorkQueue) -> int:
    """The run's status report, and what to do next. A Slurm array's tasks end together: only its
    first task reports (a report lists every commit and tally marker, ~190 LIST pages at
    100,000 shards, ~190,000 from 1,000 tasks at once); the others, their shards all committed, say
    so from the scan that found it."""
    from layertap.manifests.cli import format_status, train_hint

    task, first = os.environ.get("SLURM_ARRAY_TASK_ID"), os.environ.get("SLURM_ARRAY_TASK_MIN")
    if queue.done_state is not None and task is not None and first is not None and task != first:
        done, total = len(queue.done_state.committed), len(queue.manifest.shards)
        part = "its shards are" if cfg.shards is not None else "every shard is"
        print(f"\n{done:,} of the run's {total:,} shards committed when this array task ended ({part} done): task "
              f"{first}'s log ends with a report of the run as it found it, and `layertap status {cfg.out}` says "
              "where the run is now")
        return 0
    status = run_status(store)
    print(f"\nshards are in {store.uri}/shards/ (committed ones listed under {store.uri}/commits/)")
    # a static assignment (one Slurm array task's range) done with its own shards finishes no others
    mine_done = (not status["complete"] and cfg.shards is not None
                 and _all_committed(store, load_manifest(store), cfg.shards))
    others = ("`layertap extract` with the other tasks' --shards, or without --shards (or `layertap submit extract`)"
              if mine_done else None)
    print(format_status(status, rerun=others))
    if not status["complete"]:
        if mine_done:
            print(f"\nthe {len(cfg.shards)} shard(s) of --shards are done; the rest of the run is other workers' part")
            return 0
        print("\nthe run is not complete: run the same command again to retry failed and pending shards")
        return 1
    consumed = status.get("consumption")
    if consumed and consumed["shards_deleted"]:  # trained while extracted: a new trainer would find little left
        print(f"\ntraining consumed {consumed['shards']} of its shards while it was extracted (the data of "
              f"{consumed['shards_deleted']} deleted, --delete-consumed): the trainer's own `layertap status` "
              "says how its training went")
        return 0
    if (trainer := _consumer(store)) is not None:  # claimed, nothing deleted yet: a second trainer would race it
        print(f"\na --delete-consumed trainer writing to {trainer} trains on this run and deletes what it has "
              f"trained on: `layertap status {trainer}` says how its training goes")
        return 0
    print(f"\n{train_hint(cfg.out, cfg.s3)}")
    if not torch.cuda.is_available():
        print("  (on a CPU a step takes seconds to minutes: add --steps 10 for a first look; the bar shows the pace)")
    return 0
