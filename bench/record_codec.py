"""A record's safetensors blob: layertap's hand-written writer and parser vs the safetensors library.

    python bench/record_codec.py [--samples N] [--repeats R] [--record-mb MB] [--write-docs]

Real SmolLM2-135M hidden states (5 capture layers), one record per conversation or (--record-mb)
2 records of about MB raw each, for every codec. Single-threaded CPU time, best of R repeats, in
raw MB (bf16 activations) per CPU-second:

  decode   storage.records.decode_record (header parsed in place, the codecs read byte planes
           where they lie in the fetched range) vs the same decode with the tensors taken from
           `safetensors.deserialize`, which needs `bytes` (one copy of the range) and copies every
           tensor out again. The payloads are views into one buffer, as the loader holds them.
  encode   storage.records.encode_record (the blob as a list of the tensors' own buffers) vs the
           same tensors and metadata through `safetensors.torch.save` (one new `bytes` object),
           both hashed with xxh3-64 as the writer needs.

Both paths must give bit-identical samples; the script checks that before timing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import struct
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import safetensors  # noqa: E402
import torch  # noqa: E402
import xxhash  # noqa: E402
from safetensors.torch import save as st_save  # noqa: E402

from bench._report import machine, write_section  # noqa: E402
from layertap.storage.codecs import CODEC_NAMES, get_codec  # noqa: E402
from layertap.storage.format import ShardMeta  # noqa: E402
from layertap.storage.records import Sample, decode_record, encode_record  # noqa: E402
from tests.activations import smollm2_activations  # noqa: E402

_TORCH = {"I32": torch.int32, "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32,
          "F8_E4M3": torch.float8_e4m3fn}


def library_decode(payload: memoryview, meta: ShardMeta) -> Sample:
    """decode_record with the tensors from safetensors.deserialize instead of the in-place parser."""
    (n,) = struct.unpack_from("<Q", payload, 0)
    md = json.loads(bytes(payload[8 : 8 + n]))["__metadata__"]  # deserialize does not return it
    tensors = {}
    for name, t in safetensors.deserialize(bytes(payload)):
        if t["dtype"] == "U8":
            tensors[name] = np.frombuffer(t["data"], dtype=np.uint8).reshape(t["shape"])
        else:
            tensors[name] = torch.frombuffer(t["data"], dtype=_TORCH[t["dtype"]]).reshape(t["shape"]) \
                if t["data"] else torch.empty(t["shape"], dtype=_TORCH[t["dtype"]])
    codec, out = get_codec(md["codec"]), {}
    for name in ("hidden_states", "final_state"):
        parts = {k[len(name) + 1 :]: v for k, v in tensors.items() if k.startswith(name + ".")}
        if parts:
            out[name] = codec.decode(parts, {k[len(name) + 1 :]: v for k, v in md.items() if k.startswith(name + ".")})
    return Sample(md["sample_id"], tensors["input_ids"].to(torch.int64), torch.from_numpy(tensors["loss_mask"].copy()),
                  out["hidden_states"], out.get("final_state"))


def library_encode(sample: Sample, meta: ShardMeta) -> tuple[bytes, int]:
    """encode_record's tensors and metadata, serialized by safetensors.torch.save and hashed."""
    codec = get_codec(meta.codec)
    enc, enc_meta = codec.encode(sample.hidden_states.contiguous())
    tensors = {"input_ids": sample.input_ids.to(torch.int32), "loss_mask": sample.loss_mask.to(torch.uint8),
               **{f"hidden_states.{k}": v for k, v in enc.items()}}
    md = {"sample_id": sample.sample_id, "num_tokens": str(sample.num_tokens), "codec": meta.codec,
          **{f"hidden_states.{k}": v for k, v in enc_meta.items()}}
    blob = st_save(tensors, md)
    return blob, xxhash.xxh3_64(blob).intdigest()


def best_cpu(fn, items, repeats: int) -> float:
    """Best CPU time of this thread over `repeats` passes of fn over items (results dropped at once)."""
    best = math.inf
    for _ in range(repeats):
        t0 = time.thread_time()
        for it in items:
            fn(*it)
        best = min(best, time.thread_time() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=16, help="ShareGPT conversations (default 16)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--record-mb", type=float, help="2 records of about this many MB raw instead of one per conversation")
    ap.add_argument("--write-docs", action="store_true", help="update section record-codec of docs/benchmarks.md")
    args = ap.parse_args()

    torch.set_num_threads(1)
    acts = smollm2_activations(args.samples)
    if args.record_mb:
        need = math.ceil(args.record_mb * 1e6 / (sum(x.numel() * 2 for x in acts) / len(acts)))
        acts = [torch.cat([acts[(k * need + i) % len(acts)] for i in range(need)]) for k in range(2)]
    raw = sum(x.numel() * 2 for x in acts)
    samples = [Sample(f"s{i}", torch.arange(x.shape[0]), torch.ones(x.shape[0], dtype=torch.uint8), x)
               for i, x in enumerate(acts)]
    rows = ["| codec | decode: in place | decode: safetensors | CPU ratio | encode: list of buffers | "
            "encode: safetensors.save | CPU ratio |", "|---|---:|---:|---:|---:|---:|---:|"]
    for codec in CODEC_NAMES:
        meta = ShardMeta(run_id="r", shard_id=0, model="m", layers=list(range(acts[0].shape[1])),
                         hidden_size=acts[0].shape[2], codec=codec)
        recs = [encode_record(s, meta) for s in samples]
        fetched = bytearray(b"".join(r.payload for r in recs))  # one GET's buffer, records back to back
        views, pos = [], 0
        for r in recs:
            views.append(memoryview(fetched)[pos : pos + r.size])
            pos += r.size
        for v in views:
            a, b = decode_record(v, meta), library_decode(v, meta)
            assert torch.equal(a.hidden_states.view(torch.int16), b.hidden_states.view(torch.int16))
            assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
        dec = [best_cpu(f, [(v, meta) for v in views], args.repeats) for f in (decode_record, library_decode)]
        enc = [best_cpu(f, [(s, meta) for s in samples], args.repeats) for f in (encode_record, library_encode)]
        rows.append(f"| {codec} | {raw / dec[0] / 1e6:,.0f} | {raw / dec[1] / 1e6:,.0f} | {dec[1] / dec[0]:.2f}x | "
                    f"{raw / enc[0] / 1e6:,.0f} | {raw / enc[1] / 1e6:,.0f} | {enc[1] / enc[0]:.2f}x |")
        print(rows[-1], flush=True)
    shape = f"2 records of ~{args.record_mb:g} MB" if args.record_mb else f"{len(acts)} records, one per conversation"
    cmd = "python bench/record_codec.py" + (f" --record-mb {args.record_mb:g}" if args.record_mb else "")
    md = "\n".join([
        f"## A record's safetensors blob: hand-written vs the safetensors library ({shape})", "",
        f"`{cmd}` on {machine()}, load average {os.getloadavg()[0]:.1f}, safetensors "
        f"{safetensors.__version__}: raw MB/s per CPU-second, one thread, best of {args.repeats}, "
        f"{raw / 1e6:.1f} MB raw. The ratio is the library path's CPU over the hand-written one's.", "", *rows])
    print(md)
    if args.write_docs:
        write_section("record-codec-large" if args.record_mb else "record-codec", md)


if __name__ == "__main__":
    main()
