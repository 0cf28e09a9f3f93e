"""Measurements an estimate rests on: token statistics from the real tokenizer, and codec ratios,
format overheads and throughput from a small extraction run in memory.

The extraction goes through the extractor's own path (`extract.pipeline.extract_shard`: length
buckets, the cut model's forward, the encode pool, the shard writer) into a writer that only
counts bytes, so nothing reaches a store. It runs once, with the raw ``bf16`` codec; each codec
then re-encodes the very same bf16 states with `storage.records.encode_record`, which is exactly
what the pipeline would have written with that codec (encoding is a pure function of the states).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from layertap.extract.estimate import TOKEN_BYTES
from layertap.extract.inputs import (ACCEPTED_SHAPES, ANSWER_PAST_MAX_LENGTH, Skipped, TokenizedSample, TokenizeStats,
                                     sample_id, tokenize_rows)
from layertap.extract.model import Capture
from layertap.extract.pipeline import PipelineStats, extract_shard, pad_batch
from layertap.manifests.manifest import ShardPlan, plan_shards
from layertap.manifests.preemption import STOP_SIGNALS
from layertap.storage.codecs import CODEC_NAMES
from layertap.storage.errors import ConfigError, InputError, UserError
from layertap.storage.format import ShardMeta
from layertap.storage.records import EncodedRecord, decode_record, encode_record
from layertap.storage.store import ObjectWriter
from layertap.storage.writer import ShardWriter

log = logging.getLogger("layertap.estimate")


@dataclass(kw_only=True)
class TokenStats:
    """Token statistics of a dataset, from all its rows or an evenly spaced sample of them."""

    rows: int  # in the dataset
    rows_read: int  # tokenized
    samples_read: int
    tokens_read: int
    supervised_read: int = 0  # tokens the loss mask covers: the assistant turns' tokens
    answers_read: int = 0  # the same before truncation to max length: the answers' own length
    truncated: int = 0
    dropped_turns: int = 0  # assistant turns before a chat's first user turn (normalize_chat)
    prompted_read: int = 0  # chats with a user turn: the rows `layertap regenerate` answers
    skipped: dict[str, int] = field(default_factory=dict)
    read_counts: list[int] = field(default_factory=list)  # the tokens of each row read, in order (0 = skipped)
    picks: list[TokenizedSample] = field(default_factory=list)  # for the measured extraction
    picks_tokenize_s: float = 0.0  # tokenizing their rows, as a worker does each shard's before its forwards

    @property
    def exact(self) -> bool:
        return self.rows_read == self.rows

    @property
    def counts(self) -> list[int] | None:
        """Every row's tokens (0 = skipped): the planner's input; None unless every row was read."""
        return self.read_counts if self.exact else None

    @property
    def samples(self) -> int:
        """Samples the whole dataset yields (extrapolated from the sample's skip rate)."""
        return round(self.samples_read * self.rows / self.rows_read)

    @property
    def prompted(self) -> int:
        """Rows with a user turn in the whole dataset (extrapolated as `samples` is)."""
        return round(self.prompted_read * self.rows / self.rows_read)

    @property
    def tokens(self) -> int:
        """The samples' tokens at the mean of those read (rounded apart, the two gave a mean over
        max length: 20 samples of 1,312 tokens at --max-length 64)."""
        if self.exact or not self.samples_read:
            return round(self.tokens_read * self.rows / self.rows_read)
        return round(self.samples * self.tokens_read / self.samples_read)

    def describe(self, where: str) -> str:
        """Where the token counts come from, and what the rows read held (skips and truncation
        counted over the rows read; the totals built on them are extrapolated)."""
        how = (f"all {self.rows:,} rows of {where}" if self.exact
               else f"{self.rows_read:,} of the {self.rows:,} rows of {where} (evenly spaced; the totals extrapolated "
                    "from them)")
        skipped = sum(self.skipped.values())
        extra = f"; {skipped:,} skipped" + (f" ({', '.join(f'{k}: {v:,}' for k, v in sorted(self.skipped.items()))})"
                                            if skipped else "")
        dropped = (f"; {self.dropped_turns:,} assistant turn(s) before a chat's first user turn left out (no prompt "
                   "to answer)" if self.dropped_turns else "")
        read = "" if self.exact else " (of the rows read)"
        return f"tokenized {how}{extra}; {self.truncated:,} truncated to max length{dropped}{read}"


def token_statistics(rows, tokenizer, max_length: int, *, vocab_size: int | None = None,
                     sample_rows: int | None = None, picks: int = 0, pick_tokens: int = 0,
                     chat_template_kwargs: dict | None = None, workers: int | None = None) -> TokenStats:
    """Tokenize `rows` (or `sample_rows` of them, evenly spaced) as the extractor would.

    Also keeps up to `picks` samples for a measured extraction, spread evenly over the rows
    read until they hold `pick_tokens` tokens (long samples can end the picking early). With every row read, `counts` gives the exact
    per-row token counts the shard planner needs.

    Chat templates render in Python, so a large dataset is tokenized by up to `workers` processes
    (default `plan_workers`), in contiguous ranges merged in order: the result is the one a
    single pass gives. Small ones stay in this process, where no process start-up is paid.
    """
    n = len(rows)
    if n == 0:
        raise InputError("the dataset has no rows")
    indices = None
    if sample_rows is not None and 0 < sample_rows < n:
        indices = [i * n // sample_rows for i in range(sample_rows)]
        rows = rows.select(indices)
    read = len(rows)
    job = _TokenizeJob(tokenizer, max_length, vocab_size, chat_template_kwargs)
    processes = tokenize_processes(read, workers)
    tally = _tally_in_processes(rows, job, processes) if processes > 1 else _tally_here(rows, job)
    stats = tally.stats
    t0 = time.perf_counter()
    chosen = _picks(rows, tally.counts, indices, job, picks, pick_tokens)
    return TokenStats(rows=n, rows_read=read, samples_read=stats.samples, tokens_read=stats.tokens,
                      supervised_read=stats.supervised_tokens, answers_read=stats.answer_tokens,
                      truncated=stats.truncated,
                      dropped_turns=stats.dropped_turns, prompted_read=stats.prompted,
                      skipped=dict(Counter(stats.skipped)),
                      read_counts=tally.counts, picks=chosen, picks_tokenize_s=time.perf_counter() - t0)


def _picks(rows, counts: list[int], indices: list[int] | None, job: _TokenizeJob, picks: int,
           pick_tokens: int) -> list[TokenizedSample]:
    """Up to `picks` samples, until they hold `pick_tokens` tokens: every (rows / picks)-th row
    first, spread over the dataset, then the rows after each of those (offset 1, 2, ...), so that
    rows that yield no sample (skipped, no assistant turn) are made up for and `picks` samples are
    measured whenever the rows hold them. Chosen from the counts, then tokenized again (a few
    rows): samples sent back from worker processes would each hold a shared-memory file
    descriptor open."""
    if not picks:
        return []
    stride = max(1, len(counts) // picks)
    order = (i for offset in range(stride) for i in range(offset, len(counts), stride))  # each row once
    chosen: list[int] = []
    tokens = 0
    for i in order:
        if len(chosen) == picks or tokens >= pick_tokens:
            break
        if counts[i]:
            chosen.append(i)
            tokens += counts[i]
    chosen.sort()  # the dataset's order, as the extraction would meet them
    samples = job.outputs(rows.select(chosen)) if chosen else []
    return [replace(s, sample_id=sample_id(rows[i], indices[i] if indices is not None else i))  # the run's ids
            for i, s in zip(chosen, samples)]


PLAN_WORKERS_ENV = "LAYERTAP_PLAN_WORKERS"
MAX_PLAN_WORKERS = 32
# A worker starts in 2-4 s (a fresh interpreter imports torch and transformers and unpickles the
# tokenizer): below ~1,000 rows each (4-5 s of rendering), the start-up would eat the gain.
MIN_ROWS_PER_WORKER = 1000
CHUNK_ROWS = 500  # a worker's unit of work: ~2 s, so the bar moves and the ranges even out


def tokenize_processes(rows: int, workers: int | None = None) -> int:
    """Processes `token_statistics` tokenizes `rows` rows in: up to `workers` (default
    `plan_workers`), each given at least MIN_ROWS_PER_WORKER; 1 is this process alone."""
    return max(1, min(plan_workers() if workers is None else workers, rows // MIN_ROWS_PER_WORKER))


def plan_workers() -> int:
    """Processes that tokenize a whole dataset: ``$LAYERTAP_PLAN_WORKERS`` (1: this process
    only), else the CPUs this process may run on, at most 32.

    Every other rank waits while rank 0 plans, so its node's CPUs are free. 32 take a 900K-row
    plan from over an hour to a few minutes; each more would save seconds and hold its own
    interpreter and tokenizer (~0.4 GB)."""
    given = os.environ.get(PLAN_WORKERS_ENV)
    if given:
        try:
            value = int(given)
        except ValueError:
            value = 0
        if value < 1:
            raise ConfigError(f"{PLAN_WORKERS_ENV} must be a number of processes, 1 or more (1 tokenizes in this "
                              f"process), got {given!r}")
        return value
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(MAX_PLAN_WORKERS, cpus)


@dataclass(frozen=True)
class _TokenizeJob:
    """What tokenizing a row needs besides the row, sent once to each worker."""

    tokenizer: Any
    max_length: int
    vocab_size: int | None
    template_kwargs: dict | None

    def outputs(self, rows, start: int = 0, stats: TokenizeStats | None = None):
        return tokenize_rows(rows, self.tokenizer, self.max_length, start=start, vocab_size=self.vocab_size,
                             stats=stats, chat_template_kwargs=self.template_kwargs)


@dataclass
class _Tally:
    """What planning keeps of a range of rows: small enough to send between processes."""

    counts: list[int] = field(default_factory=list)  # tokens per row, 0 = skipped
    stats: TokenizeStats = field(default_factory=TokenizeStats)

    def add(self, out: TokenizedSample | Skipped) -> None:
        self.counts.append(0 if isinstance(out, Skipped) else len(out))

    def extend(self, other: _Tally) -> None:
        """Append the tally of the range that follows this one."""
        self.counts += other.counts
        for f in fields(TokenizeStats):
            if f.name == "skipped":
                self.stats.skipped.update(other.stats.skipped)
            else:
                setattr(self.stats, f.name, getattr(self.stats, f.name) + getattr(other.stats, f.name))


def _progress(total: int):
    from tqdm import tqdm

    return tqdm(total=total, desc="tokenize", unit="row", file=sys.stderr, mininterval=1.0)


def _tally_here(rows, job: _TokenizeJob) -> _Tally:
    tally = _Tally()
    outputs = job.outputs(rows, stats=tally.stats)  # a bad row shape or template fails here, before the bar
    with _progress(len(rows)) as bar:
        for out in outputs:
            tally.add(out)
            bar.update(1)
    return tally


def _tally_in_processes(rows, job: _TokenizeJob, processes: int) -> _Tally:
    """`_tally_here`'s tally from `processes` spawned workers, each given CHUNK_ROWS rows at a time.

    Spawned, not forked: the fork of a process whose torch started OpenMP threads (or CUDA) can
    hang, and the tokenizers library warns on a fork and turns its parallelism off. Each worker
    gets `rows` and `job` once: a
    ``datasets.Dataset`` read from files pickles by reference to its memory-mapped Arrow files, an
    in-memory one (the embedded ShareGPT, at most ~120 MB) whole. Chunks are merged in row order,
    so an error is the one a single pass raises first.
    """
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    job.outputs(rows)  # a bad row shape or template fails here, before any process starts
    read = len(rows)
    log.info("tokenizing %d rows in %d processes (%s to change)", read, processes, PLAN_WORKERS_ENV)
    pool = ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_start_worker, initargs=(rows, job, os.getpid()))
    tally = _Tally()
    try:
        with _progress(read) as bar:
            chunks = [pool.submit(_tally_chunk, a, min(a + CHUNK_ROWS, read)) for a in range(0, read, CHUNK_ROWS)]
            for chunk in chunks:
                part = chunk.result()
                tally.extend(part)
                bar.update(len(part.counts))
    except BrokenProcessPool:
        _stop(pool)
        raise UserError(f"a process tokenizing the dataset died (killed for memory?); set {PLAN_WORKERS_ENV} to "
                        f"fewer than {processes} processes (1 tokenizes in this process)") from None
    except BaseException:  # a row's error, Ctrl-C, a stop signal: no chunk is worth finishing
        _stop(pool)
        raise
    pool.shutdown()
    return tally


def _stop(pool) -> None:
    """End the workers now, mid-chunk (Python 3.14's ``kill_workers``; earlier ones have no public
    way), and drop the chunks not started. SIGKILL: they ignore the stop signals."""
    for process in list((pool._processes or {}).values()):
        process.kill()
    pool.shutdown(wait=True, cancel_futures=True)


_worker: dict[str, Any] = {}  # a worker's rows and job, from `_start_worker`


def _start_worker(rows, job: _TokenizeJob, parent: int) -> None:
    # Ctrl-C reaches the whole process group, Slurm's signals every process of the job: the parent
    # alone stops (as a preemption, with its exit code) and ends the workers.
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    threading.Thread(target=_exit_without, args=(parent,), name="parent-watch", daemon=True).start()
    _worker.update(rows=rows, job=job)


def _exit_without(parent: int) -> None:
    """Exit once the parent is gone: killed outright, it could not end its workers, which would
    otherwise wait for chunks forever (each holds both ends of its task pipe)."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def _tally_chunk(start: int, end: int) -> _Tally:
    tally = _Tally()
    for out in _worker["job"].outputs(_worker["rows"].select(range(start, end)), start, tally.stats):
        tally.add(out)
    return tally


class _CountingWriter(ObjectWriter):
    """An ObjectWriter that keeps nothing: the measurement needs sizes, not bytes."""

    key = "measure/in-memory.lts"

    def __init__(self) -> None:
        self._n = 0

    def write(self, data: bytes | memoryview) -> int:
        self._n += len(data)
        return len(data)

    def close(self) -> None:
        pass

    def abort(self) -> None:
        pass

    @property
    def bytes_written(self) -> int:
        return self._n


@dataclass(frozen=True, kw_only=True)
class CodecMeasure:
    """One codec on the measured samples: everything `extract.estimate.Storage` needs."""

    codec: str
    ratio: float  # raw / stored activation bytes
    record_overhead: float  # bytes per record beyond activations and the 5 B per token
    shard_overhead: int  # an empty shard's bytes
    shard_bytes: int  # the measured samples as one shard


@dataclass(frozen=True, kw_only=True)
class Measurement:
    samples: int
    tokens: int
    raw_bytes: int
    codecs: dict[str, CodecMeasure]
    tokens_per_s: float  # real tokens over the pipeline's wall time
    forward_tokens_per_s: float  # real tokens over the forwards alone
    device: str
    wall_s: float

    def to_json(self) -> dict[str, Any]:
        return {"samples": self.samples, "tokens": self.tokens, "raw_bytes": self.raw_bytes,
                "codecs": {k: asdict(v) for k, v in self.codecs.items()},
                "tokens_per_s": self.tokens_per_s, "forward_tokens_per_s": self.forward_tokens_per_s,
                "device": self.device, "wall_s": self.wall_s}


def measure_extraction(capture: Capture, samples: list[TokenizedSample], meta: ShardMeta, *, batch_tokens: int,
                       pad_id: int, encode_threads: int = 2, bytes_per_token: float | None = None,
                       shard_bytes: int | None = None, tokenize_s: float = 0.0) -> Measurement:
    """Extract `samples` in memory and measure every codec on their states, and the throughput.

    One short warm-up forward first, so one-time costs (allocator, kernel selection) do not
    count against the timed run. With `bytes_per_token` and `shard_bytes` (the run's plan), the
    samples go in the shards the planner would cut them into, each batched within itself as a
    worker batches them: all in one shard, small shards' forwards (2 samples of a 2 MB shard
    against 16) were timed at batches they never run at, 3x too fast. `tokenize_s`: the time the
    samples' rows took to tokenize (`TokenStats.picks_tokenize_s`), which a worker spends on each
    shard's rows before its forwards: counted in the wall time (left out, CPU runs measured 35-40%
    faster than they ran).
    """
    from tqdm import tqdm

    if not samples:
        raise InputError("no samples to measure: the dataset sample yielded none")
    warm = min(samples, key=len)
    capture(*pad_batch([warm], pad_id))
    raw_meta = replace(meta, codec="bf16")
    records: list[EncodedRecord] = []
    stats = PipelineStats()
    with tqdm(total=len(samples), desc="measure", unit="sample", file=sys.stderr, mininterval=1.0) as bar:
        def keep(rec: EncodedRecord) -> None:
            records.append(rec)
            bar.update(1)

        shards = (plan_shards([len(s) for s in samples], bytes_per_token, shard_bytes)
                  if bytes_per_token and shard_bytes else [ShardPlan(0, 0, len(samples), 0)])
        t0 = time.perf_counter()
        for shard in shards:
            extract_shard(capture, samples[shard.start:shard.end], raw_meta, _CountingWriter(), batch_tokens=batch_tokens,
                          pad_id=pad_id, encode_threads=encode_threads, stats=stats, on_record=keep)
        wall = time.perf_counter() - t0 + tokenize_s
    states = [decode_record(r.payload, raw_meta) for r in records]
    del records
    codecs = {c: _measure_codec(states, replace(meta, codec=c)) for c in CODEC_NAMES}
    device = str(next(capture.decoder.parameters()).device)
    log.info("measured %d samples, %d tokens on %s in %.1f s: %s", len(states), stats.tokens, device, wall,
             ", ".join(f"{c} {m.ratio:.3f}x" for c, m in codecs.items()))
    return Measurement(samples=len(states), tokens=stats.tokens, raw_bytes=stats.raw_bytes, codecs=codecs,
                       tokens_per_s=stats.tokens / wall, forward_tokens_per_s=stats.tokens / stats.forward_s,
                       device=device, wall_s=wall)


def _measure_codec(states, meta: ShardMeta) -> CodecMeasure:
    """Write the states as one in-memory shard with ``meta.codec``; split its bytes into activations,
    per-token, per-record and per-shard terms."""
    empty = ShardWriter(_CountingWriter(), meta).close().bytes
    shard = ShardWriter(_CountingWriter(), meta)
    raw = activations = tokens = 0
    for s in states:
        rec = encode_record(s, meta)
        # parts: the safetensors header, then input_ids (4 B/token) and loss_mask (1 B/token),
        # then the codec's tensors.
        activations += rec.size - len(rec.parts[0]) - TOKEN_BYTES * rec.num_tokens
        raw += rec.raw_bytes
        tokens += rec.num_tokens
        shard.append_encoded(rec)
    total = shard.close().bytes
    per_record = (total - empty - activations - TOKEN_BYTES * tokens) / len(states)
    return CodecMeasure(codec=meta.codec, ratio=raw / activations, record_overhead=per_record,
                        shard_overhead=empty, shard_bytes=total)


def require_samples(stats: TokenStats) -> None:
    """Refuse a dataset none of whose rows yields a sample, before a run of it is planned: it
    would "complete" with nothing stored (`layertap plan` and `estimate` refuse it too)."""
    if stats.samples_read == 0:
        reasons = ", ".join(f"{reason}: {n:,}" for reason, n in sorted(stats.skipped.items()))
        shape = f"a row needs an assistant answer to learn from, message contents in text, in an accepted shape " \
                f"({ACCEPTED_SHAPES})"
        past = "raise --max-length: the answers of some rows begin past it"
        hint = (past if set(stats.skipped) == {ANSWER_PAST_MAX_LENGTH} else f"{past}; and {shape}") \
            if stats.skipped.get(ANSWER_PAST_MAX_LENGTH) else shape
        raise InputError(f"no row of the dataset yields a sample to store: all {stats.rows_read:,} rows read were "
                         f"skipped ({reasons}); {hint}")
