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
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from layertap.extract.estimate import TOKEN_BYTES
from layertap.extract.inputs import ACCEPTED_SHAPES, Skipped, TokenizedSample, TokenizeStats, sample_id, tokenize_rows
from layertap.extract.model import Capture
from layertap.extract.pipeline import PipelineStats, extract_shard, pad_batch
from layertap.storage.codecs import CODEC_NAMES
from layertap.storage.errors import InputError
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
    truncated: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    counts: list[int] | None = None  # every row's tokens (0 = skipped), only when all rows were read
    picks: list[TokenizedSample] = field(default_factory=list)  # for the measured extraction

    @property
    def exact(self) -> bool:
        return self.rows_read == self.rows

    @property
    def samples(self) -> int:
        """Samples the whole dataset yields (extrapolated from the sample's skip rate)."""
        return round(self.samples_read * self.rows / self.rows_read)

    @property
    def tokens(self) -> int:
        return round(self.tokens_read * self.rows / self.rows_read)

    def describe(self, where: str) -> str:
        how = (f"all {self.rows:,} rows" if self.exact
               else f"{self.rows_read:,} evenly spaced of {self.rows:,} rows, extrapolated")
        skipped = sum(self.skipped.values())
        extra = f"; {skipped:,} skipped" + (f" ({', '.join(f'{k}: {v:,}' for k, v in sorted(self.skipped.items()))})"
                                            if skipped else "")
        return f"tokenized {how} of {where}{extra}; {self.truncated:,} truncated to max length"


def token_statistics(rows, tokenizer, max_length: int, *, vocab_size: int | None = None,
                     sample_rows: int | None = None, picks: int = 0, pick_tokens: int = 0,
                     chat_template_kwargs: dict | None = None) -> TokenStats:
    """Tokenize `rows` (or `sample_rows` of them, evenly spaced) as the extractor would.

    Also keeps up to `picks` samples for a measured extraction, spread evenly over the rows
    read until they hold `pick_tokens` tokens (long samples can end the picking early). With every row read, `counts` gives the exact
    per-row token counts the shard planner needs.
    """
    from tqdm import tqdm

    n = len(rows)
    if n == 0:
        raise InputError("the dataset has no rows")
    indices = None
    if sample_rows is not None and 0 < sample_rows < n:
        indices = [i * n // sample_rows for i in range(sample_rows)]
        rows = rows.select(indices)
    read = len(rows)
    stride = max(1, read // picks) if picks else 0
    stats = TokenizeStats()
    counts: list[int] = []
    chosen: list[TokenizedSample] = []
    chosen_tokens = 0
    outputs = tokenize_rows(rows, tokenizer, max_length, vocab_size=vocab_size, stats=stats,
                            chat_template_kwargs=chat_template_kwargs)
    for i, out in enumerate(tqdm(outputs, total=read, desc="tokenize", unit="row", file=sys.stderr,
                                 mininterval=1.0)):
        counts.append(0 if isinstance(out, Skipped) else len(out))
        if (stride and i % stride == 0 and isinstance(out, TokenizedSample) and len(chosen) < picks
                and chosen_tokens < pick_tokens):
            index = indices[i] if indices is not None else i
            chosen.append(replace(out, sample_id=sample_id(rows[i], index)))  # the id the run would give it
            chosen_tokens += len(out)
    return TokenStats(rows=n, rows_read=read, samples_read=stats.samples, tokens_read=stats.tokens,
                      supervised_read=stats.supervised_tokens, truncated=stats.truncated, skipped=dict(Counter(stats.skipped)),
                      counts=counts if indices is None else None, picks=chosen)


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
                       pad_id: int, encode_threads: int = 2) -> Measurement:
    """Extract `samples` in memory and measure every codec on their states, and the throughput.

    One short warm-up forward first, so one-time costs (allocator, kernel selection) do not
    count against the timed run.
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

        t0 = time.perf_counter()
        extract_shard(capture, samples, raw_meta, _CountingWriter(), batch_tokens=batch_tokens, pad_id=pad_id,
                      encode_threads=encode_threads, stats=stats, on_record=keep)
        wall = time.perf_counter() - t0
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
        raise InputError(f"no row of the dataset yields a sample to store: all {stats.rows_read:,} rows read were "
                         f"skipped ({reasons}); a row needs an assistant answer to learn from, message contents "
                         f"in text, in an accepted shape ({ACCEPTED_SHAPES})")
