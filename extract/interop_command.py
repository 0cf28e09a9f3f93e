"""`layertap export` and `layertap import`: command lines over `extract.interop`.

Built without torch (the parser of every command is built for `layertap --help`): the codec
names and id lists are checked when the command runs.
"""

from __future__ import annotations

import argparse
import sys

FORMATS = ("speculators", "specforge", "modelopt")
LAYER_HELP = ("capture layer ids in the SOURCE's own convention, in the order its files store them. "
              "speculators: HF hidden_states indices (0 is the embedding output; layertap's layer k is k+1), the "
              "capture layers only, ascending as its files always hold them (its files' last slot is the final "
              "state, which is imported as a prenorm final state); specforge (z-lab's DFlash ids) and modelopt: "
              "0-based decoder layer ids, which equal layertap's. "
              "e.g. speculators 2,17,32,47,62 = specforge/modelopt/layertap 1,16,31,46,61")


def add_export(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", metavar="RUN", help="the run prefix: s3://bucket/prefix or a folder")
    p.add_argument("--to", required=True, choices=FORMATS, dest="format",
                   help="speculators: Arrow dataset + hidden_states/hs_{i}.safetensors (needs a run extracted with "
                        "--final-state prenorm); specforge: DFlash rows_*/data_{i}.ckpt; modelopt: {id}.pt with "
                        "aux_hidden_states and the post-norm final state (needs --final-state postnorm)")
    p.add_argument("dest", metavar="DEST", help="where to write the files: a folder or s3://bucket/prefix")
    p.add_argument("--limit", type=int, help="export the first N samples (default all)")
    p.add_argument("--rows-only", action="store_true",
                   help="speculators: write only the Arrow dataset; its trainer then reads the states from the run "
                        "itself through layertap.extract.speculators_transfer.LayertapTransfer (docs/INTEROP.md)")


def run_export(args: argparse.Namespace) -> int:
    from layertap.extract.interop import export_run
    from layertap.manifests.cli import not_a_run
    from layertap.manifests.manifest import NoRun
    from layertap.storage.errors import ConfigError
    from layertap.storage.store import open_store
    from layertap.storage.units import counted, possessive

    if args.limit is not None and args.limit < 1:
        raise ConfigError(f"--limit must be >= 1, got {args.limit}")
    run = open_store(args.run)
    try:
        note = export_run(run, args.format, open_store(args.dest), limit=args.limit, rows_only=args.rows_only)
    except NoRun as e:  # said as `status` says what the prefix is instead
        raise not_a_run(run, e, "export writes the samples of", lambda data: f"it trained on {data}, which may be "
                        "exported") from None
    owner = possessive(args.format)
    print(f"exported {counted(note['samples'], 'sample')} of {args.run} to {args.dest} in {owner} layout; "
          f"layers {note['layers']} (layertap's ids) are {owner} {note[f'{args.format}_layer_ids']}")
    missing, planned = note["shards_missing"], note["shards_planned"]
    if args.limit is None and missing:  # the warnings above said why, shard by shard
        print(f"warning: {missing:,} of the run's {planned:,} shards are not in it (not committed yet, or their data "
              f"is gone): a trainer of {args.dest} trains on the others alone. Once the run is complete, export it "
              "again into a new DEST for all of it", file=sys.stderr)
    return 0


def add_import(p: argparse.ArgumentParser) -> None:
    from layertap.storage.codec_names import CODEC_NAMES

    p.add_argument("src", metavar="SRC", help="the foreign data: a folder or s3://bucket/prefix")
    p.add_argument("--from", required=True, choices=FORMATS, dest="format",
                   help="the layout SRC is in (specforge: DFlash files, or EAGLE-3 ones whose hidden_state is "
                        "imported as a postnorm final state)")
    p.add_argument("--out", required=True, help="the run prefix to create (or resume): s3://bucket/prefix or a folder")
    p.add_argument("--layers", help=LAYER_HELP + " Default: what the layertap-export.json beside SRC records "
                                                  "(data `layertap export` wrote)")
    p.add_argument("--model",
                   help="the target model's local folder (the states' model), recorded in the manifest: import "
                        "reads its hidden size there (config.json, or the --gguf-file) and `layertap train` its "
                        "embeddings. Default: the target the layertap-export.json beside SRC records, when it is on "
                        "this machine")
    p.add_argument("--gguf-file", help="GGUF file inside --model, for a target kept as GGUF (recorded like "
                                       "`layertap extract --gguf-file`)")
    p.add_argument("--codec", default="bf16-zstd", choices=CODEC_NAMES, help="hidden-state codec of the shards (default bf16-zstd)")
    p.add_argument("--shard-bytes", default="1GB", help="planned stored bytes per shard (default 1GB)")
    p.add_argument("--limit", type=int, help="import the first N samples (default all)")
    p.add_argument("--final-state", choices=["prenorm", "postnorm"],
                   help="--from modelopt: the final state (hidden_states) of files that do not say which they hold "
                        "(no hidden_states_prenorm, as older ModelOpt wrote): prenorm for its vLLM dumper's, "
                        "postnorm (the default) for its HF dumper's")


def _from_export_note(args: argparse.Namespace) -> None:
    """--model (with --gguf-file) and --layers left out: what the layertap-export.json beside SRC
    records, for data `layertap export` wrote; foreign data needs them given."""
    if args.model is not None and args.layers is not None:
        return
    from layertap.extract.interop import EXPORT_NOTE, export_note
    from layertap.storage.errors import ConfigError, MissingInput
    from layertap.storage.store import open_store
    from layertap.train.target_head import recorded_target

    src = open_store(args.src)
    note = export_note(src, args.format)
    missing = " and ".join(f for f, v in (("--model", args.model), ("--layers", args.layers)) if v is None)
    if note is None:
        if next(iter(src.list("")), None) is None:  # a typo: said as such, not as flags missing
            raise MissingInput(f"{args.src} does not exist, or holds nothing: give the folder or prefix the "
                               f"{args.format} files are in")
        if (other := export_note(src, None)) is not None and other.get("format") != args.format:
            raise ConfigError(f"{args.src} holds {other.get('format')!r} files, as its {EXPORT_NOTE} records "
                              f"(written by `layertap export`), not {args.format} ones: --from {other.get('format')}?")
        raise ConfigError(f"give {missing}: {args.src} holds no {EXPORT_NOTE} of {args.format} files (written by "
                          "`layertap export`) to take them from")
    if args.layers is None:
        ids = note.get(f"{args.format}_layer_ids")
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise ConfigError(f"give --layers: the {EXPORT_NOTE} beside {args.src} has no list of "
                              f"'{args.format}_layer_ids' to take them from (it has {ids!r})")
        args.layers = ",".join(map(str, ids))
    if args.model is None:
        args.model, args.gguf_file = recorded_target({"model": note.get("model"), "gguf_file": note.get("gguf_file")},
                                                     f"{EXPORT_NOTE} beside {args.src} records the target",
                                                     EXPORT_NOTE)


def run_import(args: argparse.Namespace) -> int:
    from layertap.extract.config import parse_ids
    from layertap.extract.interop import UNREADABLE, import_run
    from layertap.manifests.cli import format_status, train_hint
    from layertap.manifests.preemption import Preempted
    from layertap.manifests.status import run_status
    from layertap.storage.errors import ConfigError
    from layertap.storage.store import open_store
    from layertap.storage.units import counted, parse_size

    if args.limit is not None and args.limit < 1:
        raise ConfigError(f"--limit must be >= 1, got {args.limit}")
    try:
        shard_bytes = parse_size(args.shard_bytes)
    except ValueError as e:
        raise ConfigError(f"--shard-bytes: {e}") from None
    out = open_store(args.out)
    _from_export_note(args)
    try:
        import_run(open_store(args.src), args.format, out, layers=parse_ids(args.layers), model=args.model,
                   gguf_file=args.gguf_file, codec=args.codec, shard_bytes=shard_bytes, limit=args.limit,
                   final_state=args.final_state)
    except Preempted as e:
        print(f"stopped ({e}): committed shards are kept; run the same command again to resume")
        return e.exit_code
    status = run_status(out)
    print(format_status(status))
    if not status["complete"]:
        print("\nthe import is not complete: run the same command again to retry failed and pending shards")
        return 1
    if status["samples_done"] == 0:  # every sample skipped: no run to train on (the counts above say why)
        print(f"\nerror: no sample of {args.src} was stored, every one was skipped (see above): nothing to train "
              f"on; fix the source or the import's arguments, then `layertap delete {args.out}` and import again",
              file=sys.stderr)
        return 1
    reasons = status.get("skipped_by_reason") or {}
    if unread := (reasons.get("counts") or {}).get(UNREADABLE):
        least = "at least " if reasons.get("shards_read", 0) < reasons.get("shards_with_skips", 0) else ""
        print(f"\nwarning: {least}{counted(unread, 'file')} of {args.src} could not be read and "
              f"{'is' if unread == 1 else 'are'} left out of the run (the reasons above; `layertap status {args.out}` "
              f"counts them): to include them, repair them, then `layertap delete {args.out}` and import again",
              file=sys.stderr)
    print(f"\n{train_hint(args.out)}")
    return 0
