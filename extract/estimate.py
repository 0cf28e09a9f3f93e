"""Capacity arithmetic for a run: bytes, bandwidth, GPU time, requests and money, before any work.

Pure functions over small dataclasses (no I/O), so the same numbers serve
`layertap estimate`, `layertap plan --dry-run` and tests that pin the reference case.

The size model is the shard format's own layout (docs/FORMAT.md), term by term:

    stored = tokens x (activation bytes per token / codec ratio + 5 B of input_ids and loss_mask)
           + samples x record overhead (safetensors header, frame header, footer index entry)
           + shards x shard overhead (preamble, HEAD frame, fixed footer, trailer)

``raw`` counts activation bytes only (layers x hidden x 2 B of bf16 per token), the figure
the public trainers' file-per-sample layout stores (the 27B reference: 800 tokens x 51,200 B per sample).

Units: byte counts are exact integers; human units are binary (KiB, MiB, GiB, TiB = 2^10 ..
2^40 B), as in the reference "34,858.2 GB" (which is 913,786 x 800 x 51,200 / 2^30) and as S3
bills ("GB-month" is 2^30 B). Bandwidth is also given in Gbit/s (10^9 bit/s), as links are sold.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any, Mapping

from layertap.storage.codecs import CODEC_NAMES, get_codec
from layertap.storage.errors import ConfigError
from layertap.storage.units import counted

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40
BF16_BYTES = 2
TOKEN_BYTES = 5  # per token beside the activations: input_ids as int32 + loss_mask as uint8

# raw/stored ratio of the activations per codec when nothing is measured: each codec's own `ratio`,
# from SmolLM2 states (docs/benchmarks.md "Codecs": 1.461 and 2.320, rounded
# down). The planner sizes shards with these too, so a plan never depends on a measurement.
DEFAULT_RATIOS: dict[str, float] = {name: get_codec(name).ratio for name in CODEC_NAMES}

# Format overheads when nothing is measured (a 27B-shaped record measured 490-680 B with a
# 16-character sample id; an empty shard ~640 B). Noise at 1 GB shards; not for tiny models.
DEFAULT_RECORD_OVERHEAD = 600.0
DEFAULT_SHARD_OVERHEAD = 700.0

# S3 Standard, us-east-1, first 50 TB tier, as published when this was written: stated
# assumptions, printed with every estimate, overridable on the command line.
DEFAULT_USD_PER_GIB_MONTH = 0.023
DEFAULT_USD_PER_1000_PUT = 0.005  # PUT, COPY, POST, LIST
DEFAULT_USD_PER_1000_GET = 0.0004

DEFAULT_PART_BYTES = 16 * MiB  # storage.s3.S3Options.part_size
# PUT-class requests a second (PUT, POST, COPY, DELETE) S3 serves one key prefix, as AWS publishes
# it: a prefix above it is partitioned over time, throttled (SlowDown) meanwhile. Every data object
# of a run is under its `shards/`.
S3_PREFIX_PUTS_PER_S = 3_500
PART_CHOICES = tuple(m * MiB for m in (32, 64, 128, 256, 512, 1024))  # what a too-high PUT rate suggests
DEFAULT_PARTS_IN_MEMORY = 9  # storage.s3.S3Options.max_parts_in_memory: a writer's buffers
DEFAULT_RANGE_BYTES = 64 * MiB  # train.stream: the loader's coalesced ranged GETs
OPEN_GETS = 2  # train.stream.load_index: the manifest and the commit index, per rank at each trainer start
DEFAULT_EPOCHS = 6  # the DFlash recipe


def bytes_per_token_raw(*, capture_layers: int, hidden_size: int, final_state: bool = False) -> int:
    """bf16 activation bytes per token: (layers + final state) x hidden x 2."""
    return (capture_layers + int(final_state)) * hidden_size * BF16_BYTES


def planned_bytes_per_token(*, capture_layers: int, hidden_size: int, final_state: bool, codec: str) -> float:
    """Stored bytes per token the shard planner cuts shards with: raw over the codec's default ratio."""
    ratio = get_codec(codec).ratio  # unknown codec -> ValueError naming the valid ones
    raw = bytes_per_token_raw(capture_layers=capture_layers, hidden_size=hidden_size, final_state=final_state)
    return raw / ratio


def _positive(name: str, value: float | None, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if value is None or not value > 0 or not math.isfinite(value):
        raise ConfigError(f"{name} must be a positive number, got {value!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class Workload:
    """What is extracted: the model's shape, the capture layers and the data's token count."""

    hidden_size: int
    capture_layers: int
    final_state: bool = False
    samples: int
    tokens: int  # over all samples, after truncation to max_length
    num_layers: int | None = None  # the model's depth, when known
    kept_layers: int | None = None  # decoder layers the truncated forward runs, when known
    capture_depth: int | None = None  # those the capture layers alone need (the deepest + 1), when known

    def __post_init__(self) -> None:
        _positive("hidden size", self.hidden_size)
        _positive("number of capture layers", self.capture_layers)
        _positive("number of samples", self.samples)
        _positive("number of tokens", self.tokens)
        _positive("number of model layers", self.num_layers, allow_none=True)
        _positive("kept layers", self.kept_layers, allow_none=True)
        _positive("capture depth", self.capture_depth, allow_none=True)

    @property
    def mean_tokens(self) -> float:
        return self.tokens / self.samples


@dataclass(frozen=True, kw_only=True, slots=True)
class Storage:
    """How the activations are stored: the codec's ratio, format overheads, shard and part sizes."""

    codec: str
    ratio: float  # raw / stored activation bytes
    record_overhead: float = DEFAULT_RECORD_OVERHEAD
    shard_overhead: float = DEFAULT_SHARD_OVERHEAD
    shard_bytes: int = 1_000_000_000  # the planner's target
    shards: int | None = None  # a concrete plan's count; None: estimated from shard_bytes
    part_bytes: int = DEFAULT_PART_BYTES
    range_bytes: int = DEFAULT_RANGE_BYTES

    def __post_init__(self) -> None:
        get_codec(self.codec)  # unknown codec -> ValueError naming the valid ones
        _positive("codec ratio", self.ratio)
        _positive("shard size", self.shard_bytes)
        _positive("number of shards", self.shards, allow_none=True)
        if self.record_overhead < 0 or self.shard_overhead < 0:
            raise ConfigError("format overheads cannot be negative")


@dataclass(frozen=True, kw_only=True, slots=True)
class Throughput:
    """Extraction speed: real (unpadded) tokens per second per GPU, and the GPUs running."""

    tokens_per_s_per_gpu: float | None = None  # None: time, bandwidth and heartbeats are not estimated
    gpus: int = 8
    gpus_per_node: int = 8
    lease_ttl_s: float = 60.0  # a lease heartbeat (one PUT) every ttl / 4 while a shard is worked on

    def __post_init__(self) -> None:
        _positive("tokens/s per GPU", self.tokens_per_s_per_gpu, allow_none=True)
        _positive("number of GPUs", self.gpus)
        _positive("GPUs per node", self.gpus_per_node)
        _positive("lease ttl", self.lease_ttl_s)

    @property
    def nodes(self) -> int:
        return math.ceil(self.gpus / self.gpus_per_node)


@dataclass(frozen=True, kw_only=True, slots=True)
class Prices:
    """Stated prices (USD); the defaults are S3 Standard's, see the DEFAULT_USD_* constants."""

    usd_per_gib_month: float = DEFAULT_USD_PER_GIB_MONTH
    usd_per_1000_put: float = DEFAULT_USD_PER_1000_PUT
    usd_per_1000_get: float = DEFAULT_USD_PER_1000_GET
    epochs: int = DEFAULT_EPOCHS  # training passes that read the run back

    def __post_init__(self) -> None:
        for name in ("usd_per_gib_month", "usd_per_1000_put", "usd_per_1000_get"):
            value = getattr(self, name)
            if not value >= 0 or not math.isfinite(value):
                raise ConfigError(f"{name.replace('_', ' ')} must be a non-negative number, got {value!r}")
        if self.epochs < 0:
            raise ConfigError(f"epochs must be non-negative, got {self.epochs}")


@dataclass(frozen=True, kw_only=True, slots=True)
class Estimate:
    """Every number of an estimate. Bytes are exact where the inputs are; None: not estimable."""

    bytes_per_token_raw: int
    bytes_per_token_stored: float  # activations over the ratio, plus input_ids and loss_mask
    bytes_per_sample_raw: float
    bytes_per_sample_stored: float  # with the record's share of format overhead
    samples: int
    tokens: int
    total_bytes_raw: int
    total_bytes_stored: int
    shards: int
    bytes_per_shard_stored: float  # mean
    upload_bytes_per_s_per_gpu: float | None
    upload_bytes_per_s_per_node: float | None
    upload_bytes_per_s_total: float | None
    nodes: int
    wall_s: float | None
    gpu_hours: float | None
    put_requests: int  # data parts and single PUTs, commit, tally, lease, feed key, heartbeats, manifest, sweep
    data_puts_per_s: float | None  # PUT-class requests to shards/ a second, all GPUs extracting
    get_requests_per_epoch: int  # one training pass over the run by the streaming loader: the shards' data
    get_requests_first_open: int  # the run's first opening: manifest, commit index (absent), every commit
    storage_usd_per_month: float
    put_usd: float
    get_usd_per_epoch: float

    @property
    def compression(self) -> float:
        """raw / stored for the whole run, overheads included."""
        return self.total_bytes_raw / self.total_bytes_stored

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(total_gib_raw=self.total_bytes_raw / GiB, total_gib_stored=self.total_bytes_stored / GiB,
                   bytes_per_sample_raw_mib=self.bytes_per_sample_raw / MiB, compression=self.compression)
        return out


def shards_of_uniform_samples(samples: int, sample_bytes: float, shard_bytes: int) -> int:
    """`plan_shards`'s count when every sample has `sample_bytes` planned bytes (the mean).

    The planner closes a shard once its planned bytes reach `shard_bytes`, so a shard holds
    ceil(shard_bytes / sample_bytes) samples and overshoots the target by up to one sample;
    planned bytes / shard_bytes counts too many (1.8x the planner's at 32 MB shards of the 27B
    reference). Varied lengths overshoot a little more: only real counts give the exact plan.
    """
    per_shard = max(1, math.ceil(shard_bytes / sample_bytes))
    return math.ceil(samples / per_shard)


def estimate(work: Workload, storage: Storage, throughput: Throughput = Throughput(),
             prices: Prices = Prices()) -> Estimate:
    """The run's numbers; see the module docstring for the size model."""
    raw_per_token = bytes_per_token_raw(capture_layers=work.capture_layers, hidden_size=work.hidden_size,
                                        final_state=work.final_state)
    stored_per_token = raw_per_token / storage.ratio + TOKEN_BYTES
    records_bytes = work.tokens * stored_per_token + work.samples * storage.record_overhead
    if storage.shards is not None:
        shards = storage.shards
    else:
        planned = work.mean_tokens * raw_per_token / DEFAULT_RATIOS[storage.codec]
        shards = shards_of_uniform_samples(work.samples, planned, storage.shard_bytes)
    total_stored = round(records_bytes + shards * storage.shard_overhead)
    shard_mean = total_stored / shards

    tps = throughput.tokens_per_s_per_gpu
    per_gpu = per_node = total_rate = wall = gpu_hours = None
    heartbeats = 0
    if tps is not None:
        gpu_s = work.tokens / tps
        # A shard is one worker's: the run takes ceil(shards / gpus) rounds of a shard each, and no
        # more than `shards` GPUs work (and upload) at once. (It read gpu_s / gpus: 2 shards on 8
        # GPUs finished 4x sooner, and uploaded 4x faster, than they can.)
        active = min(throughput.gpus, shards)
        wall, gpu_hours = math.ceil(shards / throughput.gpus) * gpu_s / shards, gpu_s / 3600
        per_gpu = tps * total_stored / work.tokens
        per_node = per_gpu * min(active, throughput.gpus_per_node)
        total_rate = per_gpu * active
        # a claim beats after each full ttl/4 it holds its shard: shards of a few seconds never do
        heartbeats = shards * math.floor(gpu_s / shards / (throughput.lease_ttl_s / 4))

    # One PUT per shard below a part; above: create + parts + complete. Then commit, tally, lease, feed.
    data_puts = 1 if shard_mean <= storage.part_bytes else 2 + math.ceil(shard_mean / storage.part_bytes)
    puts = shards * (data_puts + 4) + heartbeats + 1 + 2  # + the manifest, the end-of-run sweep's claim and mark
    # The loader, each epoch: the shard whole when it fits one range, else trailer + footer GETs and
    # the ranges. The commits are read when a trainer starts, not each epoch: the first start reads
    # each one (the extraction writes no commit index; rank 0 then stores it), every later opening
    # the manifest and the index alone (`OPEN_GETS`; train.stream.load_index).
    reads = 1 if shard_mean <= storage.range_bytes else 2 + math.ceil(shard_mean / storage.range_bytes)
    gets = shards * reads
    return Estimate(
        bytes_per_token_raw=raw_per_token,
        bytes_per_token_stored=stored_per_token,
        bytes_per_sample_raw=work.mean_tokens * raw_per_token,
        bytes_per_sample_stored=records_bytes / work.samples,
        samples=work.samples,
        tokens=work.tokens,
        total_bytes_raw=work.tokens * raw_per_token,
        total_bytes_stored=total_stored,
        shards=shards,
        bytes_per_shard_stored=shard_mean,
        upload_bytes_per_s_per_gpu=per_gpu,
        upload_bytes_per_s_per_node=per_node,
        upload_bytes_per_s_total=total_rate,
        nodes=throughput.nodes,
        wall_s=wall,
        gpu_hours=gpu_hours,
        put_requests=puts,
        data_puts_per_s=None if wall is None else shards * data_puts / wall,
        get_requests_per_epoch=gets,
        get_requests_first_open=shards + OPEN_GETS,
        storage_usd_per_month=total_stored / GiB * prices.usd_per_gib_month,
        put_usd=puts / 1000 * prices.usd_per_1000_put,
        get_usd_per_epoch=gets / 1000 * prices.usd_per_1000_get,
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class Regeneration:
    """The step before extraction that `layertap regenerate` runs: the target writes every
    sample's assistant turns. Its cost is generated tokens at a server's decode rate, which
    batching many requests sets (one number per server, all requests in flight together)."""

    samples: int  # rows answered: every chat with a user turn, kept by the extraction or not
    answer_tokens: float  # mean new tokens per row, all its assistant turns together
    tokens_per_s_per_server: float | None = None  # None: time is not estimated
    servers: int = 1
    gpus_per_server: int = 1

    def __post_init__(self) -> None:
        _positive("number of samples", self.samples)
        _positive("answer tokens per sample", self.answer_tokens)
        _positive("generated tokens/s per server", self.tokens_per_s_per_server, allow_none=True)
        _positive("number of servers", self.servers)
        _positive("GPUs per server", self.gpus_per_server)

    @property
    def tokens(self) -> int:
        return round(self.samples * self.answer_tokens)

    @property
    def wall_s(self) -> float | None:
        rate = self.tokens_per_s_per_server
        return None if rate is None else self.tokens / (rate * self.servers)

    @property
    def gpu_hours(self) -> float | None:
        wall = self.wall_s
        return None if wall is None else wall * self.servers * self.gpus_per_server / 3600

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "tokens": self.tokens, "wall_s": self.wall_s, "gpu_hours": self.gpu_hours}

    def lines(self, source: str = "") -> list[str]:
        rate = self.tokens_per_s_per_server
        return [
            "regeneration (layertap regenerate, before extraction)",
            f"  rows answered            {self.samples:,}",
            f"  generated tokens         {self.tokens:,}  ({self.answer_tokens:,.1f} per row{source})",
            "  decode rate              " + (f"{rate:,.0f} tokens/s per server x {self.servers:,} server(s) of "
                                             f"{self.gpus_per_server} GPU(s)" if rate else
                                             "not given: add --generate-tokens-per-s N (one server's generated "
                                             "tokens/s with many requests in flight)"),
            f"  regeneration wall time   {fmt_duration(self.wall_s)}",
            f"  GPU-hours                {'n/a' if self.gpu_hours is None else f'{self.gpu_hours:,.1f}'}",
        ]


@dataclass(frozen=True, slots=True)
class Alternative:
    label: str
    codec: str
    capture_layers: int
    final_state: bool
    estimate: Estimate

    def to_json(self, base: Estimate) -> dict[str, Any]:
        e = self.estimate
        saved = base.total_bytes_stored - e.total_bytes_stored
        return {"label": self.label, "codec": self.codec, "capture_layers": self.capture_layers,
                "final_state": self.final_state, "bytes_per_token_raw": e.bytes_per_token_raw,
                "bytes_per_token_stored": e.bytes_per_token_stored, "total_bytes_raw": e.total_bytes_raw,
                "total_bytes_stored": e.total_bytes_stored, "saves_bytes": saved,
                "saves_fraction": saved / base.total_bytes_stored, "gpu_hours": e.gpu_hours,
                "upload_bytes_per_s_per_node": e.upload_bytes_per_s_per_node,
                "storage_usd_per_month": e.storage_usd_per_month}


def alternatives(work: Workload, storage: Storage, throughput: Throughput = Throughput(),
                 prices: Prices = Prices(), ratios: Mapping[str, float] | None = None) -> list[Alternative]:
    """The same run with each other codec, with the final-layer state toggled, and with fewer layers.

    ``ratios``: each codec's ratio (measured ones where there are); defaults fill the gaps.
    The final state needs every decoder layer to run, so when the model's depth is known, its
    time scales by kept layers (first order: layers dominate a truncated forward's cost).
    Fewer capture layers drop the shallowest ones: the forward stays as deep, only bytes change.
    """
    ratios = {**DEFAULT_RATIOS, **(ratios or {})}
    base = replace(storage, shards=None) if storage.shards is not None else storage

    def run(label: str, w: Workload, codec: str, tp: Throughput = throughput) -> Alternative:
        s = replace(base, codec=codec, ratio=storage.ratio if codec == storage.codec else ratios[codec])
        return Alternative(label, codec, w.capture_layers, w.final_state, estimate(w, s, tp, prices))

    out = [run(f"codec {c}", work, c) for c in DEFAULT_RATIOS if c != storage.codec]
    # with the final state the forward runs every layer; without it, only down to the deepest capture layer
    toggled = replace(work, final_state=not work.final_state,
                      kept_layers=work.num_layers if not work.final_state else work.capture_depth)
    tp = throughput
    if throughput.tokens_per_s_per_gpu and work.kept_layers and toggled.kept_layers:
        tp = replace(throughput, tokens_per_s_per_gpu=throughput.tokens_per_s_per_gpu * work.kept_layers
                     / toggled.kept_layers)
    out.append(run("with the final-layer state" if toggled.final_state else "without the final-layer state",
                   toggled, storage.codec, tp))
    for n in sorted({work.capture_layers - 1, 3} - {0}, reverse=True):
        if 0 < n < work.capture_layers:
            out.append(run(f"{n} capture layer{'s' * (n > 1)}", replace(work, capture_layers=n), storage.codec))
    return out


# -- human units ------------------------------------------------------------------------------

_BINARY = {"B": 1, "KiB": KiB, "MiB": MiB, "GiB": GiB, "TiB": TiB}


def fmt_bytes(n: float, unit: str | None = None, decimals: int | None = None) -> str:
    """'51,200 B', '39.06 MiB', '34,858.2 GiB'. Without ``unit``, the largest binary unit that
    keeps the number at least 1; decimals default to 0 for B, 2 otherwise."""
    if unit is None:
        unit = next((u for u in ("TiB", "GiB", "MiB", "KiB") if abs(n) >= _BINARY[u]), "B")
    if unit not in _BINARY:
        raise ConfigError(f"unknown unit {unit!r}; use one of {', '.join(_BINARY)}")
    if decimals is None:
        decimals = 0 if unit == "B" else 2
    return f"{n / _BINARY[unit]:,.{decimals}f} {unit}"


def fmt_rate(bytes_per_s: float | None) -> str:
    """'1.25 GiB/s (10.74 Gbit/s)'."""
    if bytes_per_s is None:
        return "n/a"
    return f"{fmt_bytes(bytes_per_s)}/s ({bytes_per_s * 8 / 1e9:,.2f} Gbit/s)"


def fmt_duration(seconds: float | None) -> str:
    """'3 d 4 h 12 min', '12 min 5 s'."""
    if seconds is None:
        return "n/a"
    s = round(seconds)
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    parts = [f"{d} d"] * bool(d) + [f"{h} h"] * bool(h) + [f"{m} min"] * bool(m)
    if not d and not h:
        parts.append(f"{s} s")
    return " ".join(parts[:3]) or "0 s"


def fmt_size(n: float, unit: str, decimals: int) -> str:
    """``n`` in ``unit`` (the reference figures' units), or in a smaller unit when below one."""
    return fmt_bytes(n, unit, decimals) if abs(n) >= _BINARY[unit] else fmt_bytes(n)


def _count(n: int, what: str) -> str:
    return f"{n:,} {what}{'s' * (n != 1)}"


def fmt_usd(usd: float) -> str:
    """'$553.01', '$0.0004', '<$0.0001'."""
    if 0 < usd < 1e-4:
        return "<$0.0001"
    return f"${usd:,.2f}" if usd >= 1 else f"${usd:.4g}"


# -- the report -------------------------------------------------------------------------------


def format_report(est: Estimate, alts: list[Alternative], work: Workload, storage: Storage,
                  throughput: Throughput, prices: Prices, sources: Mapping[str, str]) -> str:
    """The human-readable estimate. ``sources`` says where each input came from (keys: model,
    layers, data, codec, throughput), e.g. "stated" or "measured on 16 samples"."""
    src = {k: f"  ({v})" if v else "" for k, v in sources.items()}
    layers = sources.get("layers_list") or f"{work.capture_layers} layers"
    tps = throughput.tokens_per_s_per_gpu
    depth = f", {work.num_layers} decoder layers" if work.num_layers else ""
    lines = [
        "units: KiB/MiB/GiB/TiB = 2^10/2^20/2^30/2^40 bytes (S3 bills GB-months of 2^30 B); Gbit/s = 10^9 bit/s",
        "",
        "inputs",
        f"  model        hidden {work.hidden_size:,}{depth}{src.get('model', '')}",
        f"  capture      {layers}, {'with' if work.final_state else 'no'} final-layer state",
        f"  data         {work.samples:,} samples, {work.tokens:,} tokens, mean {work.mean_tokens:,.1f} tokens/sample"
        f"{src.get('data', '')}",
        f"  codec        {storage.codec}, ratio {storage.ratio:.3f}x{src.get('codec', '')}",
        "  throughput   " + (f"{tps:,.0f} tokens/s per GPU{src.get('throughput', '')}; {_count(throughput.gpus, 'GPU')}"
                              f"{src.get('gpus', '')}, {throughput.gpus_per_node} per node = "
                              f"{_count(throughput.nodes, 'node')}" if tps else
                              "not given: add --tokens-per-s N or --measure for time, bandwidth and GPU-hours"),
        f"  layout       shards of ~{storage.shard_bytes:,} B stored, upload parts of {fmt_bytes(storage.part_bytes)}, "
        f"loader ranges of {fmt_bytes(storage.range_bytes)}; format overhead {storage.record_overhead:,.0f} B "
        f"per sample, {storage.shard_overhead:,.0f} B per shard"
        + (f"  (overheads: {sources['overhead']})" if sources.get("overhead") else ""),
        "",
        f"{'size':<26}{'raw':>22}{'stored':>22}",
        f"{'  per token':<26}{fmt_bytes(est.bytes_per_token_raw, 'B'):>22}"
        f"{fmt_bytes(est.bytes_per_token_stored, 'B'):>22}",
        f"{'  per sample (mean)':<26}{fmt_size(est.bytes_per_sample_raw, 'MiB', 2):>22}"
        f"{fmt_size(est.bytes_per_sample_stored, 'MiB', 2):>22}",
        f"{'  whole run':<26}{fmt_size(est.total_bytes_raw, 'GiB', 1):>22}"
        f"{fmt_size(est.total_bytes_stored, 'GiB', 1):>22}",
        f"{'':<26}{fmt_bytes(est.total_bytes_raw, 'B'):>22}{fmt_bytes(est.total_bytes_stored, 'B'):>22}",
        f"  {counted(est.shards, 'shard')} of {fmt_bytes(est.bytes_per_shard_stored)} stored on average; "
        f"raw/stored {est.compression:.3f}x overall",
        "",
        "transfer and time",
        f"  upload per GPU           {fmt_rate(est.upload_bytes_per_s_per_gpu)}",
        f"  upload per node          {fmt_rate(est.upload_bytes_per_s_per_node)}",
        f"  upload in total          {fmt_rate(est.upload_bytes_per_s_total)}",
        f"  extraction wall time     {fmt_duration(est.wall_s)}",
        f"  GPU-hours                {'n/a' if est.gpu_hours is None else f'{est.gpu_hours:,.1f}'}",
        "",
        f"requests and cost (assumed: {fmt_usd(prices.usd_per_gib_month)} per GiB-month, "
        f"{fmt_usd(prices.usd_per_1000_put)} per 1,000 PUT, {fmt_usd(prices.usd_per_1000_get)} per 1,000 GET; "
        "LIST requests, billed as PUTs, not counted)",
        f"  PUT requests             {est.put_requests:,}  ({fmt_usd(est.put_usd)})"
        + ("" if tps else "  (without lease heartbeats: no throughput given)"),
        *_put_rate_lines(est, work, storage, throughput, prices),
        f"  GET requests per epoch   {est.get_requests_per_epoch:,}  ({fmt_usd(est.get_usd_per_epoch)}; "
        f"{prices.epochs} epochs: {fmt_usd(est.get_usd_per_epoch * prices.epochs)})",
        f"  GET requests to open     {est.get_requests_first_open:,} the first time (every commit; rank 0 then "
        f"stores the index), then {OPEN_GETS} per rank a start",
        f"  storage per month        {fmt_usd(est.storage_usd_per_month)}",
        "",
        "alternatives",
        f"  {'option':<30}{'B/token raw':>13}{'B/token stored':>16}{'run stored':>16}{'vs configured':>26}{'GPU-hours':>11}"
        f"{'storage/month':>16}",
    ]
    rows = [(f"as configured ({storage.codec})", est)] + [(a.label, a.estimate) for a in alts]
    for label, e in rows:
        delta = e.total_bytes_stored - est.total_bytes_stored
        sign = "+" if delta >= 0 else "-"
        change = "-" if e is est else f"{sign}{fmt_size(abs(delta), 'GiB', 1)} ({delta / est.total_bytes_stored:+.1%})"
        hours = "n/a" if e.gpu_hours is None else f"{e.gpu_hours:,.1f}"
        lines.append(f"  {label:<30}{fmt_bytes(e.bytes_per_token_raw, 'B'):>13}{fmt_bytes(e.bytes_per_token_stored, 'B'):>16}"
                     f"{fmt_size(e.total_bytes_stored, 'GiB', 1):>16}{change:>26}{hours:>11}"
                     f"{fmt_usd(e.storage_usd_per_month):>16}")
    return "\n".join(lines)


def _put_rate_lines(est: Estimate, work: Workload, storage: Storage, throughput: Throughput,
                    prices: Prices) -> list[str]:
    """The data PUT rate while extracting, and when it is above what an S3 prefix serves, the
    smallest upload part size that brings it under (and the memory that costs a writer)."""
    rate = est.data_puts_per_s
    if rate is None:
        return []
    lines = [f"  PUT rate to shards/      {rate:,.0f}/s while extracting (S3 serves a prefix "
             f"~{S3_PREFIX_PUTS_PER_S:,}/s before it partitions it)"]
    if rate <= S3_PREFIX_PUTS_PER_S:
        return lines
    for part in (p for p in PART_CHOICES if p > storage.part_bytes):
        r = estimate(work, replace(storage, part_bytes=part), throughput, prices).data_puts_per_s
        if r <= S3_PREFIX_PUTS_PER_S:
            return lines + [
                f"  note: expect SlowDown replies (retried) until S3 has partitioned shards/; parts of "
                f"{part // MiB} MiB give {r:,.0f}/s (--config: s3: {{part_size: {part // MiB}MiB}}; a writer then "
                f"buffers up to {fmt_bytes(DEFAULT_PARTS_IN_MEMORY * part)}, s3.max_parts_in_memory x part_size)"]
    return lines + ["  note: expect SlowDown replies (retried) until S3 has partitioned shards/; no part size up "
                    f"to {PART_CHOICES[-1] // MiB} MiB brings it under: larger shards (--shard-bytes) cut the rate"]


def report_json(est: Estimate, alts: list[Alternative], work: Workload, storage: Storage,
                throughput: Throughput, prices: Prices, sources: Mapping[str, str]) -> dict[str, Any]:
    """The estimate as one JSON-ready object: the numbers at the top level, then what they rest on."""
    return {
        **est.to_json(),
        "mean_tokens": work.mean_tokens,
        "inputs": {"workload": asdict(work), "storage": asdict(storage), "throughput": asdict(throughput),
                   "sources": dict(sources)},
        "assumptions": {**asdict(prices), "units": "bytes; *_gib_* = 2^30 B; *_mib = 2^20 B; rates in B/s",
                        "token_bytes": TOKEN_BYTES, "default_ratios": DEFAULT_RATIOS},
        "alternatives": [a.to_json(est) for a in alts],
    }
