"""`layertap inspect URI`: look inside one shard object, check every hash, and (--stats) the
statistics of its states per capture layer."""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import posixpath
import re
from dataclasses import asdict
from typing import Any


def add_inspect(p: argparse.ArgumentParser) -> None:
    p.add_argument("uri", help="a shard object, e.g. s3://bucket/run1/shards/000001-81511212108e4f1c09ab.lts or "
                               "runs/quickstart/shards/000001-81511212108e4f1c09ab.lts (`layertap status RUN "
                               "--shards` lists a run's shard objects)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--records", type=int, default=20, metavar="N", help="list at most N records (default 20; -1 all)")
    p.add_argument("--stats", action="store_true",
                   help="mean, std, max |x| and non-finite values per capture layer (and of the final state) "
                        "over every record: a sanity check of what was captured")


def _committed_hash(root: str, key: str) -> str | None:
    """The object hash the run's commit records for `key`, a shard object under a run's shards/;
    None where no commit names this very object (another attempt's, or no run above it)."""
    from layertap.manifests import layout
    from layertap.manifests.records import decode_commit
    from layertap.storage.store import open_store

    if "://" not in root:  # a local path: `shards/...` given from inside the run names no run above it
        root = os.path.abspath(os.path.expanduser(root))
    found = re.fullmatch(r"(.+)/(shards/(\d{6})-[^/]+)", f"{root.rstrip('/')}/{key}")
    if found is None:
        return None
    run, commit_key = open_store(found[1]), layout.commit_key(int(found[3]))
    try:
        commit = decode_commit(run.get(commit_key), commit_key)
    except Exception:  # noqa: BLE001 - none, or unreadable: the shard is inspected on its own
        return None
    return commit.xxh3_128 if commit.data_key == found[2] else None


def run_inspect(args: argparse.Namespace) -> int:
    from layertap.storage.errors import InputError
    from layertap.storage.format import MAGIC
    from layertap.storage.reader import ShardReader, verify_shard
    from layertap.storage.store import ObjectNotFound, StoreError, open_store, split_object_uri
    from layertap.storage.units import counted

    if args.records < -1:
        raise InputError(f"--records must be a count of records, or -1 for all of them; got {args.records}")
    root, key = split_object_uri(args.uri)
    store = open_store(root)
    try:
        store.size(key)  # a missing object or a bad key is a usage error, not a corrupt shard
    except ObjectNotFound as e:
        if open_store(args.uri).exists("manifest.json"):
            raise StoreError(f"{args.uri} is a run, not a shard object: `layertap status {args.uri} --shards` "
                             "lists its shards' objects, one of which `layertap inspect` takes") from None
        if (shard := re.fullmatch(r"(\d+)(\.lts)?", key)) is not None:
            # a shard named by its id alone (shards/1.lts, 000001.lts: without its digest): its objects, one
            # listing of that shard's names (a missing bucket is named by it as every other command names it)
            near = [o.key for o in itertools.islice(store.list(f"{int(shard[1]):06d}-"), 3)]
            if near:
                named = " or ".join(posixpath.join(root, k) for k in near)
                raise ObjectNotFound(f"{e}; did you mean {named}? (`layertap status RUN --shards` names each shard's "
                                     "committed object)") from None
        elif root.startswith("s3://"):  # a HEAD's 404 does not say whether the bucket exists; a listing does
            next(iter(store.list(key)), None)
        raise
    head = store.get_range(key, 0, min(len(MAGIC), store.size(key)))
    if not key.endswith(".lts") and head != MAGIC:  # a run's other file given by mistake, not a damaged shard
        raise InputError(f"{args.uri} is not a layertap shard (it starts with {bytes(head)!r}): `layertap status RUN "
                         "--shards` lists a run's shard objects")
    # a corrupt shard is a report (exit 1), not an error; its commit's hash tells a damaged version field
    # from a newer layertap's shard, as `verify` tells them (said "upgrade layertap" of a corrupt one)
    report = verify_shard(store, key, expected_xxh3_128=_committed_hash(root, key), decode=True)
    reader = ShardReader(store, key) if report.ok else None
    stats = layer_stats(reader) if reader is not None and args.stats else None
    if args.json:
        out = {"uri": args.uri, "ok": report.ok, "error": report.error, "bytes": report.bytes,
               "xxh3_128": report.xxh3_128}
        if reader:
            out.update(meta=reader.meta.to_json(), num_records=len(reader), num_tokens=reader.footer["num_tokens"],
                       raw_bytes=reader.footer["raw_bytes"], relative_error=reader.footer.get("relative_error"),
                       records=[asdict(e) for e in _shown(reader.entries, args.records)])
            if stats is not None:
                out["stats"] = stats
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
    print(f"  codec {m.codec}  ratio " + (f"{ratio:.3f}x" if f["raw_bytes"] else "- (no records)")
          + (f"  relative error {f['relative_error']:.4%}" if f.get("relative_error") is not None else ""))
    print(f"  {counted(len(reader), 'record')}  {counted(f['num_tokens'], 'token')}  {counted(report.bytes, 'byte')}  "
          f"xxh3-128 {report.xxh3_128}")
    if isinstance(produced := m.extra.get("produced_by"), dict):  # free-form (FORMAT.md §3): shown when it is ours
        software, kernels = produced.get("software"), produced.get("kernels")
        print(f"  produced on {produced.get('device', '?')}"
              + (" with " + ", ".join(f"{k}={v}" for k, v in software.items()) if isinstance(software, dict) else ""))
        for kind, choices in (kernels.items() if isinstance(kernels, dict) else ()):
            print(f"    {kind}: {', '.join(map(str, choices)) if isinstance(choices, list) else choices}")
    shown = _shown(reader.entries, args.records)
    for i, e in enumerate(shown):
        print(f"  [{i:5,d}] {e.sample_id:<32} tokens {e.num_tokens:6,d}  bytes {e.length:11,d}  @ {e.offset:,}")
    if len(shown) < len(reader):
        print(f"  ... {len(reader) - len(shown):,} more (--records -1 lists all)")
    if stats is not None:
        print(f"  statistics over {counted(len(reader), 'record')} ({stats['tokens']:,} tokens x {m.hidden_size} "
              "values a layer):")
        print(f"    {'layer':<18}{'mean':>12}{'std':>12}{'max |x|':>12}{'non-finite':>12}")
        rows = [(str(r["layer"]), r) for r in stats["layers"]]
        if stats["final_state"]:
            rows.append((f"final ({m.final_state})", stats["final_state"]))
        for name, r in rows:
            print(f"    {name:<18}{_num(r['mean']):>12}{_num(r['std']):>12}{_num(r['max_abs']):>12}{r['nonfinite']:>12,}")
    return 0


def _shown(entries: list, n: int) -> list:
    return entries if n < 0 else entries[:n]


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.4g}"


def layer_stats(reader) -> dict[str, Any]:
    """Mean, std, max |x| and the count of non-finite values of the stored states, per capture
    layer (and of the final state), over every record; the moments over the finite values only.
    Accumulated in float64 from the decoded bf16."""
    n_layers = len(reader.meta.layers)
    acc = {"layers": _Moments(n_layers), "final": _Moments(1)}
    tokens = 0
    for sample in reader:
        tokens += sample.num_tokens
        acc["layers"].add(sample.hidden_states.transpose(0, 1).reshape(n_layers, -1))
        if sample.final_state is not None:
            acc["final"].add(sample.final_state.reshape(1, -1))
    layers = [{"layer": layer, **row} for layer, row in zip(reader.meta.layers, acc["layers"].rows())]
    final = acc["final"].rows()[0] if acc["final"].count.sum() or acc["final"].nonfinite.sum() else None
    return {"tokens": tokens, "layers": layers, "final_state": final}


class _Moments:
    """Running sums per row of [rows, values] chunks."""

    def __init__(self, rows: int):
        import torch

        self.count = torch.zeros(rows, dtype=torch.float64)
        self.sum = torch.zeros(rows, dtype=torch.float64)
        self.sumsq = torch.zeros(rows, dtype=torch.float64)
        self.max_abs = torch.zeros(rows, dtype=torch.float64)
        self.nonfinite = torch.zeros(rows, dtype=torch.int64)

    def add(self, x) -> None:
        import torch

        x = x.double()
        finite = torch.isfinite(x)
        self.nonfinite += (~finite).sum(dim=1)
        x = torch.where(finite, x, torch.zeros((), dtype=x.dtype))
        self.count += finite.sum(dim=1)
        self.sum += x.sum(dim=1)
        self.sumsq += (x * x).sum(dim=1)
        if x.shape[1]:
            self.max_abs = torch.maximum(self.max_abs, x.abs().amax(dim=1))

    def rows(self) -> list[dict[str, Any]]:
        out = []
        for c, s, q, m, bad in zip(self.count.tolist(), self.sum.tolist(), self.sumsq.tolist(),
                                   self.max_abs.tolist(), self.nonfinite.tolist()):
            mean = s / c if c else None
            std = math.sqrt(max(q / c - mean * mean, 0.0)) if c else None
            out.append({"mean": mean, "std": std, "max_abs": m if c else None, "nonfinite": int(bad)})
        return out
