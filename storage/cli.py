"""`layertap inspect URI`: look inside one shard object and check every hash."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict



def add_inspect(p: argparse.ArgumentParser) -> None:
    p.add_argument("uri", help="a shard object: s3://bucket/prefix/shards/00001.lts or a local path")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--records", type=int, default=20, metavar="N", help="list at most N records (default 20; -1 all)")


def run_inspect(args: argparse.Namespace) -> int:
    from storage.shard import ShardError, ShardReader, verify_shard
    from storage.store import StoreError, open_store, split_object_uri

    try:
        root, key = split_object_uri(args.uri)
        store = open_store(root)
        store.size(key)  # a missing object or a bad key is a usage error, not a corrupt shard
        report = verify_shard(store, key, decode=True)
        reader = ShardReader(store, key) if report.ok else None
    except (StoreError, ShardError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        out = {"uri": args.uri, "ok": report.ok, "error": report.error, "bytes": report.bytes,
               "xxh3_128": report.xxh3_128}
        if reader:
            out.update(meta=reader.meta.to_json(), num_records=len(reader), num_tokens=reader.footer["num_tokens"],
                       raw_bytes=reader.footer["raw_bytes"], relative_error=reader.footer["relative_error"],
                       records=[asdict(e) for e in reader.entries])
        print(json.dumps(out, indent=2))
        return 0 if report.ok else 1
    if reader is None:
        print(f"CORRUPT {args.uri}\n  {report.error}")
        return 1
    m, f = reader.meta, reader.footer
    ratio = f["raw_bytes"] / max(1, report.bytes)
    print(f"{args.uri}  OK (every hash verified)")
    print(f"  run {m.run_id}  shard {m.shard_id}  model {m.model}"
          f"{'@' + m.model_revision if m.model_revision else ''}  tokenizer {m.tokenizer}")
    print(f"  layers {m.layers} ({m.layer_convention})  final_state {m.final_state}  hidden {m.hidden_size}  {m.dtype}")
    print(f"  codec {m.codec}  ratio {ratio:.3f}x"
          + (f"  relative error {f['relative_error']:.4%}" if f["relative_error"] is not None else ""))
    print(f"  {len(reader)} records  {f['num_tokens']} tokens  {report.bytes} bytes  xxh3-128 {report.xxh3_128}")
    shown = reader.entries if args.records < 0 else reader.entries[: args.records]
    for i, e in enumerate(shown):
        print(f"  [{i:5d}] {e.sample_id:<32} tokens {e.num_tokens:6d}  bytes {e.length:10d}  @ {e.offset}")
    if len(shown) < len(reader):
        print(f"  ... {len(reader) - len(shown)} more (--records -1 lists all)")
    return 0
