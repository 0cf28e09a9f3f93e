"""`layertap estimate` and `layertap plan`: a run's bytes, bandwidth, GPU time and cost, before it runs.

Both accept every `layertap extract` option, so an extract command line turns into its estimate
or its plan by changing the verb. `estimate` also takes stated numbers instead of a model or a
dataset (--hidden-size, --num-layers, --samples, --mean-tokens). `plan` works on the concrete
run: it tokenizes the whole dataset, cuts the same shard plan `extract` would, and, without
--dry-run, writes that plan as the run's manifest (nothing else) so that a later `extract` or
`submit` finds it; with --dry-run it writes nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import dataclass
from typing import Any

from layertap.extract.command import add_extract
from layertap.storage.errors import ConfigError, UserError
from layertap.storage.store import s3_options
from layertap.storage.units import counted
from layertap.extract.estimate import (DEFAULT_EPOCHS, DEFAULT_RATIOS, DEFAULT_USD_PER_1000_GET, DEFAULT_USD_PER_1000_PUT,
                              DEFAULT_USD_PER_GIB_MONTH, Prices, Regeneration, Storage, Throughput, Workload,
                              alternatives, estimate, fmt_bytes, format_report, report_json)


def _add_cost_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("codec ratio, throughput and prices")
    g.add_argument("--ratio", type=float, help="stated raw/stored ratio of --codec's activations (default: "
                   "measured with --measure, else " + ", ".join(f"{c} {r}" for c, r in DEFAULT_RATIOS.items()) + ")")
    g.add_argument("--measure", action="store_true",
                   help="load the weights and extract a few samples in memory (nothing is written): measures every "
                        "codec's ratio, the format overheads and tokens/s on this machine")
    g.add_argument("--measure-samples", type=int, default=16, help="samples in the measured extraction (default 16)")
    g.add_argument("--measure-tokens", type=int, default=16384,
                   help="stop picking samples to measure once they hold this many tokens (default 16384)")
    g.add_argument("--tokens-per-s", type=float, help="stated real (unpadded) tokens/s per GPU; overrides --measure's")
    g.add_argument("--gpus", type=int, help="GPUs extracting at once (default 8; 1 when --measure runs on this "
                                          "machine's CPU, which then stands for the one process it measured)")
    g.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node, for upload per node (default 8)")
    g.add_argument("--price-per-gb-month", type=float, default=DEFAULT_USD_PER_GIB_MONTH,
                   help=f"USD per GiB-month stored (default {DEFAULT_USD_PER_GIB_MONTH}: S3 Standard)")
    g.add_argument("--put-price-per-1000", type=float, default=DEFAULT_USD_PER_1000_PUT,
                   help=f"USD per 1,000 PUT/POST requests (default {DEFAULT_USD_PER_1000_PUT})")
    g.add_argument("--get-price-per-1000", type=float, default=DEFAULT_USD_PER_1000_GET,
                   help=f"USD per 1,000 GET requests (default {DEFAULT_USD_PER_1000_GET})")
    g.add_argument("--epochs", type=int, default=DEFAULT_EPOCHS,
                   help=f"training passes reading the run back, for GET costs (default {DEFAULT_EPOCHS})")
    p.add_argument("--json", action="store_true", help="print one JSON object (for scripts)")


def _add_regeneration_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("regeneration (layertap regenerate), when asked")
    g.add_argument("--regenerate", action="store_true",
                   help="also estimate regenerating the answers of every row with a user turn, with the target, "
                        "before extraction")
    g.add_argument("--answer-tokens", type=float,
                   help="mean new tokens per row answered (default: the dataset's own assistant tokens per sample "
                        "the extraction keeps)")
    g.add_argument("--generate-tokens-per-s", type=float,
                   help="generated tokens/s of one server with many requests in flight (e.g. vLLM's reported "
                        "generation throughput); without it, no time")
    g.add_argument("--servers", type=int, help="servers generating at once (default: --gpus / --gpus-per-server)")
    g.add_argument("--gpus-per-server", type=int, default=1, help="GPUs per server (tensor parallel; default 1)")


def add_estimate(p: argparse.ArgumentParser) -> None:
    add_extract(p)
    for action in p._actions:  # extract's --out is required there; here it is not used
        if action.dest == "out":
            action.help = "not used by estimate (accepted so that an extract command line works unchanged)"
    g = p.add_argument_group("stated inputs (instead of loading a model or reading a dataset)")
    g.add_argument("--hidden-size", type=int, help="the model's hidden size, e.g. 5120 (with --num-layers or --layers)")
    g.add_argument("--num-layers", type=int, help="the model's decoder layers, e.g. 64: with --hidden-size, unless --layers is "
                                                         "given (DFlash's 5 capture layers are spaced over them)")
    g.add_argument("--samples", type=int, help="samples in the run (default: counted in the dataset)")
    g.add_argument("--mean-tokens", type=float, help="mean tokens per sample (default: measured on the dataset)")
    g.add_argument("--token-sample", type=int, default=10_000,
                   help="rows tokenized for token statistics, evenly spaced, extrapolated to the dataset "
                        "(default 10000; 0: every row, which also gives the exact shard count)")
    _add_cost_options(p)
    _add_regeneration_options(p)


def add_plan(p: argparse.ArgumentParser) -> None:
    add_extract(p)
    p.add_argument("--dry-run", action="store_true",
                   help="show the shard plan and the estimate without writing anything (without it, plan writes "
                        "the run's manifest only)")
    _add_cost_options(p)


def run_estimate(args: argparse.Namespace) -> int:
    return _print(_estimate, args)


def run_plan(args: argparse.Namespace) -> int:
    return _print(_plan, args)


def _print(build, args: argparse.Namespace) -> int:
    """Build the report; print it as text or JSON."""
    report = build(args)
    print(json.dumps(report.to_json(), indent=2) if args.json else report.text())
    return 0


@dataclass
class _Report:
    """An estimate with everything it rests on, ready to print either way."""

    work: Workload
    storage: Storage
    throughput: Throughput
    prices: Prices
    sources: dict[str, str]
    measured: Any = None  # extract.measure.Measurement
    regeneration: Regeneration | None = None

    def __post_init__(self) -> None:
        ratios = {c: m.ratio for c, m in self.measured.codecs.items()} if self.measured else None
        self.estimate = estimate(self.work, self.storage, self.throughput, self.prices)
        self.alternatives = alternatives(self.work, self.storage, self.throughput, self.prices, ratios)

    def _args(self) -> tuple:
        return (self.estimate, self.alternatives, self.work, self.storage, self.throughput, self.prices, self.sources)

    def text(self) -> str:
        text = format_report(*self._args())
        if self.regeneration is not None:
            source = self.sources.get("answer_tokens", "")
            text += "\n\n" + "\n".join(self.regeneration.lines(f"; {source}" if source else ""))
        return text

    def to_json(self) -> dict[str, Any]:
        out = report_json(*self._args())
        if self.measured is not None:
            out["measured"] = self.measured.to_json()
        if self.regeneration is not None:
            out["regeneration"] = self.regeneration.to_json()
        return out


def _config(args: argparse.Namespace, out: str):
    """The ExtractConfig the same flags would give `layertap extract` (flags over --config)."""
    from layertap.extract.config import load_config

    return load_config(args, out=out)


def _device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _check_options(args: argparse.Namespace) -> None:
    for name in ("measure_samples", "measure_tokens", "gpus", "gpus_per_node"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    for name in ("ratio", "tokens_per_s", "samples", "mean_tokens", "hidden_size", "num_layers"):
        value = getattr(args, name, None)
        if value is not None and not value > 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {value}")
    for name in ("price_per_gb_month", "put_price_per_1000", "get_price_per_1000"):
        value = getattr(args, name, None)
        if value is not None and not (value >= 0 and math.isfinite(value)):
            raise ConfigError(f"--{name.replace('_', '-')} must be 0 or more, got {value}")
    if getattr(args, "mean_tokens", None) is not None and args.mean_tokens < 2:
        raise ConfigError(f"--mean-tokens {args.mean_tokens:g} is under 2: a sample is stored only with two consecutive "
                          "supervised tokens, so the samples a run keeps hold 2 or more on average")
    if getattr(args, "token_sample", 0) < 0:
        raise ConfigError(f"--token-sample must be 0 (every row) or positive, got {args.token_sample}")


def _estimate(args: argparse.Namespace) -> _Report:
    _check_options(args)
    cfg = _config(args, args.out or "")
    stated_model = args.hidden_size is not None or args.num_layers is not None
    if stated_model and args.model:
        raise ConfigError("give either --model or --hidden-size/--num-layers, not both")
    if stated_model and args.measure:
        raise ConfigError("--measure runs the model: give --model (or neither, for the embedded SmolLM2) "
                         "instead of --hidden-size/--num-layers")
    if args.mean_tokens is not None and args.mean_tokens > cfg.max_length:
        raise ConfigError(f"--mean-tokens {args.mean_tokens:g} is above --max-length {cfg.max_length}: extraction "
                          "truncates every sample to --max-length tokens, so state the mean after truncation "
                          "(at most --max-length), or raise --max-length")
    stated_data = args.samples is not None and args.mean_tokens is not None
    target = capture = identity = None
    if stated_model:
        shape = _stated_shape(args, cfg)
        sources = {"model": "stated"}
    else:
        from layertap.extract.regenerated import template_kwargs
        from layertap.extract.run import prepare_target

        if not stated_data or args.measure:  # the dataset's chats are rendered: settings refused before the load
            cfg.chat_template_kwargs = template_kwargs(cfg.dataset, cfg.chat_template_kwargs, cfg.s3)
        target, capture, identity = prepare_target(cfg, _device(), weights=args.measure)
        sources = {"dtype": target.info["dtype"]}  # the forward's: --dtype auto chose it for this device
        shape = dict(hidden_size=identity.hidden_size, layers=identity.layers,
                     num_layers=target.info["num_layers"], kept_layers=capture.kept_layers)
        sources["model"] = identity.model
    sources["layers_list"] = f"layers {shape['layers']}"

    stats = None
    if not stated_data or args.measure:
        if target is None:
            raise ConfigError("token statistics need the model's tokenizer: give --model, or state both "
                             "--samples and --mean-tokens")
        from layertap.extract.measure import require_samples, token_statistics
        from layertap.extract.run import dataset_rows

        rows, _ = dataset_rows(cfg)
        stats = token_statistics(rows, target.tokenizer, cfg.max_length, vocab_size=target.info["vocab_size"],
                                 sample_rows=args.token_sample or None,
                                 picks=args.measure_samples if args.measure else 0, pick_tokens=args.measure_tokens,
                                 chat_template_kwargs=cfg.chat_template_kwargs)
        if args.regenerate and stats.prompted_read and not stats.samples_read:
            raise ConfigError("the dataset's rows hold prompts and no answers: the extraction after `layertap "
                              "regenerate` cannot be sized from them. State it: --samples N (the rows) --mean-tokens "
                              "M (prompt + answer) --answer-tokens A, or estimate the regenerated dataset")
        require_samples(stats)
    samples = args.samples if args.samples is not None else stats.samples
    mean = args.mean_tokens if args.mean_tokens is not None else stats.tokens_read / stats.samples_read
    tokens = stats.tokens if args.samples is None and args.mean_tokens is None else round(samples * mean)
    where = cfg.dataset or "the embedded ShareGPT conversations"
    sources["data"] = ("stated" if stated_data else
                       stats.describe(where) + ("" if args.samples is None and args.mean_tokens is None
                                                else "; some values stated"))
    shards = None
    if stats is not None and args.samples is None and args.mean_tokens is None:
        shards = _shard_count(stats.counts, shape, cfg) if stats.counts is not None else \
            _shards_from_sample(stats.read_counts, stats.rows, shape, cfg)
    measured = _measure(cfg, target, capture, identity, stats) if args.measure else None
    work = Workload(hidden_size=shape["hidden_size"], capture_layers=len(shape["layers"]),
                    final_state=cfg.final_state != "none", samples=samples, tokens=tokens,
                    num_layers=shape["num_layers"], kept_layers=shape["kept_layers"],
                    capture_depth=max(shape["layers"]) + 1)
    report = _report(args, cfg, work, shards, measured, sources)
    _note_planned_run(cfg)
    # every chat with a user turn is answered, those the extraction then skips too (past --max-length)
    answered = stats.prompted if stats is not None and args.samples is None else samples
    report.regeneration = _regeneration(args, answered, stats, sources)
    return report


def _regeneration(args: argparse.Namespace, rows: int, stats, sources: dict[str, str]) -> Regeneration | None:
    """The regeneration step's numbers, when --regenerate asks for them."""
    stated = [f"--{n}" for n in ("answer-tokens", "generate-tokens-per-s", "servers")
              if getattr(args, n.replace("-", "_")) is not None]
    if not args.regenerate:
        if stated:
            raise ConfigError(f"{', '.join(stated)} describe the regeneration step: add --regenerate")
        return None
    answer = args.answer_tokens
    if answer is not None:
        sources["answer_tokens"] = "stated"
    elif stats is not None and stats.samples_read:
        answer = stats.answers_read / stats.samples_read  # whole: a regenerated answer is not cut at --max-length
        sources["answer_tokens"] = "the dataset's own answers, tokenized: the target's may be longer or shorter"
    else:
        raise ConfigError("--regenerate needs the answers' length: give --answer-tokens N (mean new tokens per "
                          "sample) or let the dataset be tokenized (drop --samples/--mean-tokens)")
    for name in ("gpus_per_server", "servers"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    servers = args.servers if args.servers is not None else max(1, _gpus(args, None) // args.gpus_per_server)
    return Regeneration(samples=rows, answer_tokens=answer, tokens_per_s_per_server=args.generate_tokens_per_s,
                        servers=servers, gpus_per_server=args.gpus_per_server)


def _stated_shape(args: argparse.Namespace, cfg) -> dict[str, Any]:
    """Model shape from --hidden-size, --num-layers and --layers, checked as the extractor would."""
    if args.hidden_size is None:
        raise ConfigError("--num-layers needs --hidden-size too (or give --model)")
    layers, final_state = cfg.layers, cfg.final_state
    n = args.num_layers
    if layers is None:
        if n is None:
            raise ConfigError("give --num-layers (DFlash's 5 layers are spaced over it) or --layers with "
                             "--hidden-size")
        from layertap.extract.model import default_layers

        layers = default_layers(n)
    if n is not None and any(not 0 <= k < n for k in layers):
        raise ConfigError(f"capture layers {layers} are out of range for --num-layers {n} (ids 0..{n - 1})")
    if len(set(layers)) != len(layers):
        raise ConfigError(f"capture layers repeat: {layers}")
    kept = n if final_state != "none" else max(layers) + 1
    return dict(hidden_size=args.hidden_size, layers=layers, num_layers=n, kept_layers=kept)


def _shard_count(counts: list[int], shape: dict[str, Any], cfg) -> int:
    return len(_shard_plan(counts, shape, cfg))


def _note_planned_run(cfg) -> None:
    """Say on stderr where --out names a run planned already: the estimate is of a new plan (--out is
    not used), while `extract` with the same line resumes that run's own, whose shards may differ."""
    if not cfg.out:
        return
    from layertap.manifests.manifest import NoRun, load_manifest
    from layertap.storage.store import StoreError, open_configured_store

    try:
        run = load_manifest(open_configured_store(cfg.out, cfg.s3))
    except (NoRun, StoreError, UserError):
        return
    print(f"note: {cfg.out} holds run {run.run_id}, planned already ({counted(len(run.shards), 'shard')} cut at "
          f"{run.shard_bytes:,} B): this estimates a new plan of these settings; `layertap plan --dry-run` with the "
          "same command line shows that run's own, which `layertap extract` resumes", file=sys.stderr)


def _shards_from_sample(read: list[int], rows: int, shape: dict[str, Any], cfg) -> int | None:
    """The planner's shards over the rows read (an evenly spaced sample), scaled to all `rows` by
    its rows per full shard (the last, partial one left out): by the mean sample's bytes alone
    (`shards_of_uniform_samples`), shards of 2 samples counted 3 where a few short ones pulled the
    mean down, 25-30% too few. None when the sample fills no shard: that rule then."""
    plan = _shard_plan(read, shape, cfg)
    if len(plan) < 2:
        return None
    full = plan[:-1]
    return math.ceil(rows / (sum(p.num_samples for p in full) / len(full)))


def _shard_plan(counts: list[int], shape: dict[str, Any], cfg):
    from layertap.extract.estimate import planned_bytes_per_token
    from layertap.manifests.manifest import plan_shards

    bpt = planned_bytes_per_token(capture_layers=len(shape["layers"]), hidden_size=shape["hidden_size"],
                                  final_state=cfg.final_state != "none", codec=cfg.codec)
    return plan_shards(counts, bpt, cfg.shard_bytes)


def _measure(cfg, target, capture, identity, stats):
    from layertap.extract.measure import measure_extraction
    from layertap.extract.model import padding_id
    from layertap.extract.run import plan_bytes_per_token, shard_meta

    pad_id = padding_id(target)
    meta = shard_meta(cfg, identity, run_id="0" * 12, shard_id=0)
    return measure_extraction(capture, stats.picks, meta, batch_tokens=cfg.batch_tokens, pad_id=pad_id,
                              encode_threads=cfg.encode_threads, bytes_per_token=plan_bytes_per_token(cfg, identity),
                              shard_bytes=cfg.shard_bytes, tokenize_s=stats.picks_tokenize_s)


def _gpus(args: argparse.Namespace, measured) -> int:
    """--gpus, else 8, else 1 when --measure ran on a CPU: that measured one process of this
    machine, not a GPU of a fleet (it printed a CPU's speed times 8 GPUs)."""
    if args.gpus is not None:
        return args.gpus
    return 1 if measured is not None and measured.device == "cpu" else 8


def _report(args: argparse.Namespace, cfg, work: Workload, shards: int | None, measured,
            sources: dict[str, str]) -> _Report:
    """Storage, throughput and prices from the options and the measurement; stated values win."""
    m = measured.codecs[cfg.codec] if measured else None
    if args.ratio is not None:
        ratio, sources["codec"] = args.ratio, "stated"
    elif m is not None:
        ratio, sources["codec"] = m.ratio, f"measured on {measured.samples} samples, {measured.tokens:,} tokens"
    else:
        ratio, sources["codec"] = DEFAULT_RATIOS[cfg.codec], "the codec's default, measured on SmolLM2"
    sources["overhead"] = "measured" if m else "defaults"
    storage = Storage(codec=cfg.codec, ratio=ratio, shard_bytes=cfg.shard_bytes, shards=shards,
                      part_bytes=s3_options(cfg.s3).part_size,
                      **({"record_overhead": m.record_overhead, "shard_overhead": m.shard_overhead} if m else {}))
    tps = args.tokens_per_s
    if tps is not None:
        sources["throughput"] = "stated"
    elif measured is not None:
        tps = measured.tokens_per_s
        sources["throughput"] = (f"measured on this machine's {measured.device}, {sources['dtype']} forward, "
                                 f"whole pipeline; forward alone {measured.forward_tokens_per_s:,.0f} tokens/s")
    if args.gpus is None and measured is not None and measured.device == "cpu":
        sources["gpus"] = "this machine's one process, measured on its CPU: --gpus N for a fleet"
    throughput = Throughput(tokens_per_s_per_gpu=tps, gpus=_gpus(args, measured), gpus_per_node=args.gpus_per_node,
                            lease_ttl_s=cfg.lease_ttl_s)
    prices = Prices(usd_per_gib_month=args.price_per_gb_month, usd_per_1000_put=args.put_price_per_1000,
                    usd_per_1000_get=args.get_price_per_1000, epochs=args.epochs)
    return _Report(work, storage, throughput, prices, sources, measured)


@dataclass
class _PlanReport:
    head: list[str]
    payload: dict[str, Any]
    report: _Report

    def text(self) -> str:
        return "\n".join(self.head) + self.report.text()

    def to_json(self) -> dict[str, Any]:
        return {**self.payload, "estimate": self.report.to_json()}


def _plan(args: argparse.Namespace) -> _PlanReport:
    """The concrete run's plan and estimate; writes the manifest unless --dry-run."""
    _check_options(args)
    if not args.out and not args.dry_run:
        raise ConfigError("plan writes the run's manifest: give --out s3://bucket/prefix or a local folder "
                         "(or --dry-run to only look)")
    cfg = _config(args, args.out or "")
    from layertap.extract.measure import require_samples, token_statistics
    from layertap.extract.run import dataset_rows, plan_bytes_per_token, prepare_target, resume_run, write_plan
    from layertap.manifests import layout
    from layertap.manifests.manifest import NoRun, plan_shards, refuse_new_run_here
    from layertap.storage.store import open_configured_store

    store = None
    if cfg.out:
        store = open_configured_store(cfg.out, cfg.s3)
        if not store.exists(layout.MANIFEST):  # as extract does: before tokenizing, and --dry-run too (it only reads)
            refuse_new_run_here(store)
    rows, fingerprint = dataset_rows(cfg)
    target, capture, identity = prepare_target(cfg, _device(), weights=args.measure)
    existing = None
    if store is not None:
        try:  # this only reads, and refuses a run made with other settings
            existing, identity = resume_run(store, cfg, identity, fingerprint)
        except NoRun:
            pass
    stats = token_statistics(rows, target.tokenizer, cfg.max_length, vocab_size=target.info["vocab_size"],
                             picks=args.measure_samples if args.measure else 0, pick_tokens=args.measure_tokens,
                             chat_template_kwargs=cfg.chat_template_kwargs)
    require_samples(stats)
    if existing is not None:  # the run keeps the plan it was cut with (a warning names another --shard-bytes)
        plan, planned, cfg.shard_bytes = existing.shards, existing.bytes_per_token, existing.shard_bytes
    else:
        planned = plan_bytes_per_token(cfg, identity)
        plan = plan_shards(stats.counts, planned, cfg.shard_bytes)
    measured = _measure(cfg, target, capture, identity, stats) if args.measure else None
    work = Workload(hidden_size=identity.hidden_size, capture_layers=len(identity.layers),
                    final_state=cfg.final_state != "none", samples=stats.samples, tokens=stats.tokens,
                    num_layers=target.info["num_layers"], kept_layers=capture.kept_layers,
                    capture_depth=max(identity.layers) + 1)
    sources = {"model": identity.model, "layers_list": f"layers {identity.layers}",
               "dtype": target.info["dtype"], "data": stats.describe(cfg.dataset or "the embedded ShareGPT conversations")}
    report = _report(args, cfg, work, len(plan), measured, sources)

    est, storage = report.estimate, report.storage
    sizes = []
    for s in plan:
        records = sum(1 for c in stats.counts[s.start:s.end] if c)
        sizes.append(s.est_tokens * est.bytes_per_token_stored + records * storage.record_overhead
                     + storage.shard_overhead)
    written, run_id = False, existing.run_id if existing else None
    if not args.dry_run:
        manifest, written = write_plan(store, cfg, identity, fingerprint, stats.counts)
        run_id = manifest.run_id
    prefix = store.uri if store is not None else None
    if existing is not None:
        state = f"run {existing.run_id} already planned ({len(existing.shards):,} shards, its own plan): " \
                f"`layertap extract` resumes it; `layertap status {prefix}` shows its progress"
    elif written:
        state = f"wrote the manifest of new run {run_id}: `layertap extract` with the same options runs it"
    elif prefix:
        state = f"no run at {prefix} yet; `layertap plan` without --dry-run writes its manifest, `layertap extract` runs it"
    else:
        state = "no --out given: not checked against an existing run"
    head = [
        f"plan for {prefix or '(no --out)'}" + ("  (dry run: nothing written)" if args.dry_run else ""),
        f"  run        {state}",
        f"  shards     {counted(len(plan), 'shard')} cut at {cfg.shard_bytes:,} B of planned bytes "
        f"({planned:,.0f} B/token: the codec's default ratio){' when the run was planned' if existing else ''}; "
        "estimated stored bytes per shard "
        f"min {fmt_bytes(min(sizes))}, median {fmt_bytes(statistics.median(sizes))}, max {fmt_bytes(max(sizes))}",
        "",
    ]
    payload = {"prefix": prefix, "dry_run": args.dry_run, "written": written, "run_id": run_id,
               "existing_run": existing is not None, "shards": len(plan), "shard_bytes_target": cfg.shard_bytes,
               "planned_bytes_per_token": planned,
               "bytes_per_shard_stored": {"min": min(sizes), "median": statistics.median(sizes), "max": max(sizes)}}
    return _PlanReport(head, payload, report)
