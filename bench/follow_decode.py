"""Follow mode's decoding: a follow stream that decodes on its consumer's thread vs on decode
threads (the samples its shuffle emits next), beside a plain stream, over the same finished run.

    python bench/follow_decode.py --run RUN [--samples 400] [--rounds 3] [--shuffle-buffer 64]

RUN: a local folder or s3:// prefix of a finished run (e.g. the recipe bench's
/tmp/layertap-bench-recipe/run-bf16-zstd). A finished run is what a follow stream sees when
extraction is ahead of training: every shard already committed, so the pace is the stream's own.
Rounds alternate the modes; each reads the first --samples samples of epoch 0. Prints decoded
MB/s (bf16 activation bytes yielded per second) per mode, medians, and the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from layertap.train import ShardStream, StreamConfig

MODES = {"follow, decode on the consumer's thread": dict(follow=True, decode_threads=0),
         "follow, decode threads (auto)": dict(follow=True),
         "plain, decode threads (auto)": dict(follow=False)}


def one_pass(run: str, samples: int, shuffle_buffer: int, **kw) -> dict:
    stream = ShardStream(run, config=StreamConfig(seed=0, shuffle_buffer=shuffle_buffer, follow_poll_s=1.0, **kw))
    t0, n, decoded = time.perf_counter(), 0, 0
    for sample in stream:
        decoded += sample["hidden_states"].numel() * 2
        n += 1
        if n == samples:
            break
    s = time.perf_counter() - t0
    return {"seconds": s, "samples": n, "decoded_mb_per_s": decoded / s / 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", required=True)
    ap.add_argument("--samples", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--shuffle-buffer", type=int, default=64)
    ap.add_argument("--json", help="write the raw passes and medians here")
    args = ap.parse_args()
    passes: dict[str, list[dict]] = {m: [] for m in MODES}
    for r in range(args.rounds):
        for mode in (list(MODES) if r % 2 == 0 else list(reversed(MODES))):
            passes[mode].append(one_pass(args.run, args.samples, args.shuffle_buffer, **MODES[mode]))
            print(f"round {r} {mode}: {passes[mode][-1]['decoded_mb_per_s']:.0f} MB/s", flush=True)
    med = {m: statistics.median(p["decoded_mb_per_s"] for p in v) for m, v in passes.items()}
    base = med["follow, decode on the consumer's thread"]
    report = {"run": args.run, "samples": args.samples, "rounds": args.rounds, "shuffle_buffer": args.shuffle_buffer,
              "cores": os.cpu_count(), "load_avg": [round(x, 2) for x in os.getloadavg()],
              "decoded_mb_per_s_median": med, "vs_consumer_thread": {m: v / base for m, v in med.items()},
              "passes": passes}
    print(json.dumps({k: v for k, v in report.items() if k != "passes"}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            f.write(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
