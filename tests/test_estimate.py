"""`layertap estimate` and `layertap plan`: the reference numbers exactly, the arithmetic by hand, and
measured-mode estimates against a real (tiny, random-init) extraction's stored bytes."""

from __future__ import annotations

import json
import math

import pytest

from layertap.cli import main as cli
from layertap.extract.estimate import (OPEN_GETS, GiB, MiB, Prices, Storage, Throughput, Workload, alternatives,
                              estimate, fmt_bytes,
                              planned_bytes_per_token,
                              fmt_duration, fmt_rate, fmt_usd)
from layertap.manifests.manifest import load_manifest, plan_shards
from layertap.storage.store import open_store
from test_extract import write_chats
from tiny_models import tiny_model_dir

# The BRIEF's reference case: Qwen3.6-27B (64 layers, hidden 5120), DFlash's 5 capture layers.
REF_SAMPLES, REF_TOKENS = 913_786, 800
REF = ["estimate", "--hidden-size", "5120", "--num-layers", "64", "--samples", str(REF_SAMPLES),
       "--mean-tokens", str(REF_TOKENS)]


def run_json(capsys, args: list[str]) -> dict:
    assert cli(args + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_reference_numbers_from_the_pure_functions():
    work = Workload(hidden_size=5120, capture_layers=5, samples=REF_SAMPLES, tokens=REF_SAMPLES * REF_TOKENS)
    est = estimate(work, Storage(codec="bf16-zstd", ratio=1.45))
    assert est.bytes_per_token_raw == 51_200
    assert est.bytes_per_sample_raw == 40_960_000 and fmt_bytes(est.bytes_per_sample_raw, "MiB") == "39.06 MiB"
    assert est.total_bytes_raw == 913_786 * 800 * 51_200 == 37_428_674_560_000
    assert fmt_bytes(est.total_bytes_raw, "GiB", 1) == "34,858.2 GiB"
    assert est.bytes_per_token_stored == pytest.approx(51_200 / 1.45 + 5)
    with_final = estimate(Workload(hidden_size=5120, capture_layers=5, final_state=True, samples=1, tokens=1),
                          Storage(codec="bf16", ratio=1.0))
    assert with_final.bytes_per_token_raw == 61_440 == 51_200 + 10_240


def test_reference_numbers_from_the_command(capsys):
    out = run_json(capsys, REF + ["--tokens-per-s", "7200", "--gpus", "64"])
    assert out["bytes_per_token_raw"] == 51_200
    assert out["bytes_per_sample_raw"] == 40_960_000 and round(out["bytes_per_sample_raw_mib"], 2) == 39.06
    assert out["total_bytes_raw"] == 37_428_674_560_000 and round(out["total_gib_raw"], 1) == 34_858.2
    assert out["inputs"]["workload"]["capture_layers"] == 5  # DFlash's spacing over 64 layers
    final = next(a for a in out["alternatives"] if a["label"] == "with the final-layer state")
    assert final["bytes_per_token_raw"] == 61_440
    assert out["bytes_per_token_stored"] == pytest.approx(51_200 / 1.45 + 5)
    stored_per_token = out["total_bytes_stored"] / out["tokens"]
    assert out["upload_bytes_per_s_per_node"] == pytest.approx(7200 * 8 * stored_per_token)
    assert out["upload_bytes_per_s_total"] == pytest.approx(7200 * 64 * stored_per_token)
    assert out["gpu_hours"] == pytest.approx(913_786 * 800 / 7200 / 3600)
    for key in ("bytes_per_token_stored", "total_bytes_stored", "put_requests", "get_requests_per_epoch",
                "storage_usd_per_month"):
        assert out[key] > 0, key

    assert cli(REF + ["--final-state", "prenorm"]) == 0
    text = capsys.readouterr().out
    assert "61,440 B" in text and "51,200 B" in text  # the run with, the alternative without
    assert cli(REF) == 0
    text = capsys.readouterr().out
    for figure in ("51,200 B", "39.06 MiB", "34,858.2 GiB", "37,428,674,560,000 B", "61,440 B", "GPU-hours",
                   "$0.023 per GiB-month", "layers [1, 16, 31, 46, 61]"):
        assert figure in text, figure


def test_arithmetic_by_hand():
    """Every derived number of a small case, computed here independently."""
    work = Workload(hidden_size=100, capture_layers=2, samples=10, tokens=1000, num_layers=8, kept_layers=5)
    storage = Storage(codec="bf16", ratio=1.0, record_overhead=20, shard_overhead=50, shard_bytes=100_000,
                      part_bytes=5 * MiB, range_bytes=64 * MiB)
    tp = Throughput(tokens_per_s_per_gpu=100, gpus=4, gpus_per_node=2, lease_ttl_s=8)
    prices = Prices(usd_per_gib_month=2.0, usd_per_1000_put=1.0, usd_per_1000_get=0.5, epochs=3)
    est = estimate(work, storage, tp, prices)
    assert est.bytes_per_token_raw == 400 and est.bytes_per_token_stored == 405
    assert est.shards == 4  # 40,000 planned bytes a sample: 3 close a shard, 10 samples fill 4
    assert est.total_bytes_stored == 1000 * 405 + 10 * 20 + 4 * 50 == 405_400
    assert est.bytes_per_sample_stored == (405_000 + 200) / 10
    assert est.wall_s == 1000 / 100 / 4 and est.gpu_hours == 10 / 3600
    assert est.upload_bytes_per_s_per_gpu == pytest.approx(100 * 405.4)
    assert est.upload_bytes_per_s_per_node == pytest.approx(2 * 100 * 405.4)
    assert est.upload_bytes_per_s_total == pytest.approx(4 * 100 * 405.4) and est.nodes == 2
    # 4 shards x (1 PUT + commit + tally + lease + feed key) + 4 heartbeats (2.5 GPU-s a shard: one beat
    # after 2 s in each) + the manifest + the end-of-run sweep's claim and mark
    assert est.put_requests == 4 * 5 + 4 + 1 + 2
    assert est.data_puts_per_s == 4 * 1 / est.wall_s  # one PUT per shard to shards/, over the wall time
    assert est.get_requests_per_epoch == 4 * 1  # one whole-object GET per shard: commits are read at a start
    assert est.get_requests_first_open == 4 + 2  # every commit, the manifest and the (absent) index
    assert est.storage_usd_per_month == pytest.approx(405_400 / GiB * 2.0)
    assert est.put_usd == pytest.approx(27 / 1000) and est.get_usd_per_epoch == pytest.approx(4 / 2000)

    # fewer shards than GPUs: a shard is one worker's, so 2 shards on 8 GPUs take a shard's whole time
    # and upload at 2 GPUs' rate (it read a quarter of that time, at 8 GPUs' rate); 5 on 4 take 2 rounds
    few = estimate(work, Storage(codec="bf16", ratio=1.0, shards=2), Throughput(tokens_per_s_per_gpu=100, gpus=8))
    assert few.wall_s == 1000 / 100 / 2 and few.upload_bytes_per_s_total == pytest.approx(2 * few.upload_bytes_per_s_per_gpu)
    assert few.upload_bytes_per_s_per_node == pytest.approx(2 * few.upload_bytes_per_s_per_gpu)
    rounds = estimate(work, Storage(codec="bf16", ratio=1.0, shards=5), Throughput(tokens_per_s_per_gpu=100, gpus=4))
    assert rounds.wall_s == pytest.approx(2 * 1000 / 100 / 5) and rounds.gpu_hours == 10 / 3600

    big = estimate(work, Storage(codec="bf16", ratio=1.0, shards=1, part_bytes=5 * MiB, range_bytes=64 * MiB),
                   prices=prices)
    assert big.shards == 1 and big.wall_s is None and big.gpu_hours is None
    huge = estimate(Workload(hidden_size=5120, capture_layers=5, samples=1000, tokens=800_000),
                    Storage(codec="bf16", ratio=1.0, shards=1))  # one 41 GB shard
    parts = math.ceil(huge.total_bytes_stored / (16 * MiB))
    assert huge.put_requests == 2 + parts + 4 + 1 + 2 and huge.data_puts_per_s is None  # no throughput: no rate
    assert huge.get_requests_per_epoch == 2 + math.ceil(huge.total_bytes_stored / (64 * MiB))

    alts = {a.label: a for a in alternatives(work, storage, tp, prices, ratios={"fp8": 2.0})}
    assert set(alts) == {"codec bf16-zstd", "codec fp8", "with the final-layer state", "1 capture layer"}
    assert alts["codec fp8"].estimate.bytes_per_token_stored == 400 / 2.0 + 5
    assert alts["codec bf16-zstd"].estimate.bytes_per_token_stored == pytest.approx(400 / 1.45 + 5)
    final = alts["with the final-layer state"].estimate
    assert final.bytes_per_token_raw == 600 and final.gpu_hours == pytest.approx(10 / 3600 * 8 / 5)  # all 8 layers run
    assert alts["1 capture layer"].estimate.bytes_per_token_raw == 200
    # the other way: configured with the final state (all 8 layers), the alternative without it runs only
    # down to the deepest capture layer, faster by 8/5 (it kept all 8 layers' time before)
    deep = Workload(hidden_size=100, capture_layers=2, final_state=True, samples=10, tokens=1000, num_layers=8,
                    kept_layers=8, capture_depth=5)
    without = next(a for a in alternatives(deep, storage, tp, prices) if a.label == "without the final-layer state")
    assert without.estimate.gpu_hours == pytest.approx(estimate(deep, storage, tp, prices).gpu_hours * 5 / 8)


def test_get_counts_are_the_loaders_own(s3_bucket, tmp_path):
    """The GETs the estimate counts, against the GetObject requests a real stream sends to S3: it
    counted a commit GET per shard every epoch (and per extra rank), where a stream reads the
    commits once, when it opens the run, and from the commit index after the first start."""
    from collections import Counter

    from layertap.train import ShardStream, StreamConfig

    uri = f"s3://{s3_bucket}/run"
    assert cli(["extract", "--model", tiny_model_dir(tmp_path, "llama"), "--dataset",
                write_chats(tmp_path / "chats.jsonl", 20), "--out", uri, "--layers", "1,3", "--max-length", "48",
                "--shard-bytes", "20KB", "--log-dir", str(tmp_path / "logs")]) == 0

    def gets(action) -> int:
        store, calls = open_store(uri), Counter()
        store.client.meta.events.register("before-call.s3", lambda model, **_: calls.update([model.name]))
        action(store)
        return calls["GetObject"]

    def open_and_store_index(store):
        assert ShardStream(store).refresh_index()  # what `layertap train` has rank 0 do at a start

    committed = sum(1 for o in open_store(uri).list("commits/"))
    first = gets(open_and_store_index)
    later = gets(lambda store: ShardStream(store, config=StreamConfig(seed=0)))
    shards = len(ShardStream(uri).shards)
    epochs = gets(lambda store: [sum(1 for _ in ShardStream(store)) for _ in range(2)])  # two streams' epochs
    est = estimate(Workload(hidden_size=64, capture_layers=2, samples=20, tokens=500),
                   Storage(codec="bf16", ratio=1.0, shards=shards))
    assert first == est.get_requests_first_open == committed + 2
    assert later == OPEN_GETS == 2
    assert epochs == 2 * (OPEN_GETS + est.get_requests_per_epoch) == 2 * (2 + shards)


def test_a_put_rate_above_what_an_s3_prefix_serves_names_the_part_size_that_fits(capsys, tmp_path):
    """1,000 GPUs writing 16 MiB parts of a 27B target's shards PUT ~20,000 parts a second to one
    prefix (shards/), where S3 serves ~3,500 before it partitions it: the estimate says so, and
    which part size brings the rate under; the part size of --config's s3 settings is the one used."""
    at_scale = REF + ["--tokens-per-s", "9400", "--gpus", "1000"]
    out = run_json(capsys, at_scale)
    assert out["data_puts_per_s"] > 3_500 and out["inputs"]["storage"]["part_bytes"] == 16 * MiB
    assert cli(at_scale) == 0
    text = capsys.readouterr().out
    note = next(line for line in text.splitlines() if line.startswith("  note: expect SlowDown"))
    suggested = int(note.split("parts of ")[1].split(" MiB")[0])
    fitted = run_json(capsys, at_scale + ["--config", str(_config(tmp_path, suggested))])
    assert fitted["inputs"]["storage"]["part_bytes"] == suggested * MiB and fitted["data_puts_per_s"] <= 3_500
    assert f"give {fitted['data_puts_per_s']:,.0f}/s" in note
    half = run_json(capsys, at_scale + ["--config", str(_config(tmp_path, suggested // 2))])
    assert half["data_puts_per_s"] > 3_500  # the smallest that fits was named
    assert cli(REF + ["--tokens-per-s", "9400", "--gpus", "64"]) == 0
    assert "PUT rate to shards/" in (small := capsys.readouterr().out) and "note: expect SlowDown" not in small
    assert cli(at_scale + ["--config", str(_config(tmp_path, 1))]) == 2  # below S3's 5 MiB minimum
    assert "part_size" in capsys.readouterr().err


def _config(tmp_path, part_mib: int):
    path = tmp_path / f"parts-{part_mib}.json"
    path.write_text(json.dumps({"s3": {"part_size": f"{part_mib}MiB"}}))
    return path


@pytest.mark.parametrize("codec, tokens, shard_bytes", [("bf16", 37, 10_000_000), ("bf16-zstd", 800, 32_000_000),
                                                        ("fp8", 513, 1_000_000_000), ("bf16", 10, 1_000_000)])
def test_shard_count_is_the_planners_for_uniform_lengths(codec, tokens, shard_bytes):
    """A shard closes once it reaches shard_bytes, so it overshoots by up to one sample: the
    estimate must count the planner's shards, not planned bytes / shard_bytes."""
    samples, hidden, layers = 20_011, 5120, 5
    work = Workload(hidden_size=hidden, capture_layers=layers, samples=samples, tokens=samples * tokens)
    est = estimate(work, Storage(codec=codec, ratio=1.45, shard_bytes=shard_bytes))
    planned = planned_bytes_per_token(capture_layers=layers, hidden_size=hidden, final_state=False, codec=codec)
    assert est.shards == len(plan_shards([tokens] * samples, planned, shard_bytes))


def test_units():
    assert fmt_bytes(51_200, "B") == "51,200 B"
    assert fmt_bytes(3 * MiB) == "3.00 MiB" and fmt_bytes(512) == "512 B"
    assert fmt_rate(1.25 * GiB) == "1.25 GiB/s (10.74 Gbit/s)" and fmt_rate(None) == "n/a"
    assert fmt_duration(3 * 86400 + 4 * 3600 + 12 * 60 + 5) == "3 d 4 h 12 min"
    assert fmt_duration(725) == "12 min 5 s" and fmt_duration(0) == "0 s"
    assert fmt_usd(553.014) == "$553.01" and fmt_usd(0.0004) == "$0.0004" and fmt_usd(1e-6) == "<$0.0001"
    with pytest.raises(ValueError, match="unknown unit 'GB'"):
        fmt_bytes(1, "GB")


def test_bad_inputs_name_the_input(capsys, tmp_path):
    cases = [
        (REF + ["--model", str(tmp_path)], "either --model or --hidden-size"),
        (["estimate", "--num-layers", "64", "--samples", "1", "--mean-tokens", "2"], "--num-layers needs --hidden-size"),
        (["estimate", "--hidden-size", "5120", "--samples", "1", "--mean-tokens", "2"], "give --num-layers"),
        (REF + ["--layers", "1,64"], "out of range for --num-layers 64"),
        (REF + ["--ratio", "-1"], "--ratio must be positive"),
        (REF + ["--gpus", "0"], "--gpus must be at least 1"),
        (REF + ["--measure"], "--measure runs the model"),
        (["estimate", "--hidden-size", "5120", "--num-layers", "64", "--samples", "10"],
         "token statistics need the model's tokenizer"),
        (REF + ["--shard-bytes", "lots"], "invalid size 'lots'"),
        (REF + ["--price-per-gb-month", "-1"], "--price-per-gb-month must be 0 or more, got -1"),  # said "usd per gib month"
        (REF + ["--put-price-per-1000", "nan"], "--put-price-per-1000 must be 0 or more, got nan"),
        (["estimate", "--hidden-size", "5120", "--num-layers", "64", "--samples", "1", "--mean-tokens", "0.4"],
         "--mean-tokens 0.4 is under 2"),  # said "number of tokens ... got 0"
        (["plan", "--model", str(tmp_path)], "plan writes the run's manifest: give --out"),
    ]
    for args, message in cases:
        assert cli(args) == 2, args
        assert message in capsys.readouterr().err, (args, message)
    with pytest.raises(ValueError, match="hidden size must be a positive number"):
        Workload(hidden_size=0, capture_layers=5, samples=1, tokens=1)
    with pytest.raises(ValueError, match="codec ratio"):
        Storage(codec="bf16", ratio=0)
    with pytest.raises(ValueError, match="unknown codec 'zip'"):
        Storage(codec="zip", ratio=1)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny model and 60 chats, planned with `plan --dry-run`, then `plan`, then extracted."""
    root = tmp_path_factory.mktemp("estimate")
    model = tiny_model_dir(root, "llama")
    data = write_chats(root / "chats.jsonl", 60)
    args = ["--model", model, "--dataset", data, "--layers", "1,3", "--max-length", "48", "--shard-bytes", "64KB",
            "--batch-tokens", "256"]
    return {"root": root, "args": args, "out": str(root / "run")}


def test_plan_dry_run_writes_nothing_and_plan_writes_the_manifest_extract_resumes(run, capsys):
    out, args = run["out"], run["args"] + ["--out", run["out"]]
    dry = run_json(capsys, ["plan", *args, "--dry-run"])
    assert dry["dry_run"] and not dry["written"] and not dry["existing_run"]
    assert dry["estimate"]["samples"] == 60 and dry["estimate"]["shards"] == dry["shards"] >= 3
    assert not (run["root"] / "run").exists()

    assert cli(["plan", *args, "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "dry run: nothing written" in text and f"{dry['shards']} shards cut at 64,000 B" in text

    wrote = run_json(capsys, ["plan", *args])
    assert wrote["written"] and wrote["shards"] == dry["shards"]
    store = open_store(out)
    manifest = load_manifest(store)
    assert manifest.run_id == wrote["run_id"] and len(manifest.shards) == dry["shards"]
    assert [o.key for o in store.list()] == ["manifest.json"]  # the manifest only

    again = run_json(capsys, ["plan", *args])
    assert again["existing_run"] and not again["written"] and again["run_id"] == manifest.run_id

    assert cli(["extract", *args, "--log-dir", str(run["root"] / "logs")]) == 0  # resumes the planned run
    assert load_manifest(store).run_id == manifest.run_id
    capsys.readouterr()

    changed = [a if a != "1,3" else "1,2" for a in args]
    assert cli(["plan", *changed, "--dry-run"]) == 2
    assert "layers: run has [1, 3], now [1, 2]" in capsys.readouterr().err


@pytest.mark.parametrize("dry_run", [[], ["--dry-run"]])
def test_plan_refuses_a_prefix_no_run_may_take_before_it_reads_the_dataset(run, tmp_path, capsys, dry_run):
    """`extract` refuses a folder of other files before it loads anything; `plan` said so only once
    it had tokenized every row (minutes at 900K), and `plan --dry-run` never: it said `plan` would
    write the manifest there."""
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    args = [a if a != run["args"][run["args"].index("--dataset") + 1] else str(tmp_path / "absent.jsonl")
            for a in run["args"]]  # a dataset it would fail to read: the prefix is refused first
    assert cli(["plan", *args, "--out", str(foreign), *dry_run]) == 2
    err = capsys.readouterr().err
    assert f"{foreign}" in err and "not a layertap run" in err and "absent.jsonl" not in err, err
    assert sorted(p.name for p in foreign.iterdir()) == ["notes.txt"]


def test_measured_estimate_is_within_5_percent_of_the_extraction(run, capsys):
    if not (run["root"] / "run" / "manifest.json").exists():  # run alone: extract first
        assert cli(["extract", *run["args"], "--out", run["out"], "--log-dir", str(run["root"] / "logs")]) == 0
    capsys.readouterr()
    status = run_json(capsys, ["status", run["out"]])
    assert status["complete"]

    est = run_json(capsys, ["estimate", *run["args"], "--measure", "--measure-samples", "8"])
    m = est["measured"]
    assert 0 < m["samples"] <= 8 and m["tokens"] > 0 and m["tokens_per_s"] > 0
    assert est["samples"] == status["samples_done"] and est["tokens"] == status["tokens_done"]
    assert est["shards"] == status["shards_total"]
    assert est["total_bytes_raw"] == status["bytes_raw"]
    assert abs(est["total_bytes_stored"] / status["bytes_stored"] - 1) < 0.05, (est["total_bytes_stored"],
                                                                              status["bytes_stored"])
    assert est["inputs"]["sources"]["codec"].startswith("measured on")
    assert est["gpu_hours"] == pytest.approx(est["tokens"] / m["tokens_per_s"] / 3600)
    # measured on this CPU: one process, not 8 GPUs (the wall time was a CPU's speed times 8)
    assert m["device"] == "cpu" and est["inputs"]["throughput"]["gpus"] == 1
    assert "measured on its CPU" in est["inputs"]["sources"]["gpus"]
    assert est["wall_s"] == pytest.approx(est["gpu_hours"] * 3600, rel=0.05)
    fp8 = next(a for a in est["alternatives"] if a["codec"] == "fp8")
    assert fp8["bytes_per_token_stored"] == pytest.approx(256 / m["codecs"]["fp8"]["ratio"] + 5)

    # Stated values win over measured ones; a token sample is extrapolated and says so.
    stated = run_json(capsys, ["estimate", *run["args"], "--ratio", "2", "--tokens-per-s", "50",
                               "--token-sample", "20"])
    assert stated["inputs"]["storage"]["ratio"] == 2 and stated["inputs"]["throughput"]["tokens_per_s_per_gpu"] == 50
    assert "20 of the 61 rows of" in stated["inputs"]["sources"]["data"]
    assert abs(stated["samples"] - 60) <= 3
    # its shards, from the planner over the rows read: the mean sample's bytes counted 25-30% too few
    # where a shard holds 2 or 3 samples
    for shard_bytes in ("64KB", "12KB", "6KB"):
        args = [*run["args"], "--shard-bytes", shard_bytes]
        exact = run_json(capsys, ["plan", *args, "--dry-run"])["shards"]
        sampled = run_json(capsys, ["estimate", *args, "--token-sample", "20"])["shards"]
        assert abs(sampled - exact) <= max(1, 0.1 * exact), (shard_bytes, sampled, exact)


def test_measure_takes_as_many_samples_as_asked_when_some_rows_yield_none(run, tmp_path, capsys):
    """Every (rows / 16)-th row was taken and a row that yields no sample was not made up for: with
    every fourth row unanswered, 8 samples were measured of the 16 asked (the report said 8)."""
    rows = [json.loads(line) for line in open(write_chats(tmp_path / "chats.jsonl", 24))][:24]
    with open(tmp_path / "holes.jsonl", "w") as f:
        for i in range(32):
            row = rows.pop(0) if i % 4 else {"id": f"hole-{i}", "messages": [{"role": "user", "content": "hi?"}]}
            f.write(json.dumps(row) + "\n")
    args = [a if not a.endswith("chats.jsonl") else str(tmp_path / "holes.jsonl") for a in run["args"]]
    est = run_json(capsys, ["estimate", *args, "--measure", "--measure-samples", "16"])
    assert est["samples"] == 24 and est["measured"]["samples"] == 16
    assert est["inputs"]["sources"]["codec"].startswith("measured on 16 samples")
    few = run_json(capsys, ["estimate", *args, "--measure", "--measure-samples", "30"])
    assert few["measured"]["samples"] == 24  # all the rows hold


def test_empty_id_lists_are_refused_not_defaulted(capsys):
    """`--layers ""` (a shell variable left empty) must not quietly become the default layers, in
    `estimate` as in `extract` and `submit`."""
    assert cli(["estimate", "--layers", "", "--limit", "5"]) == 2
    assert "no capture layers given" in capsys.readouterr().err


def test_regeneration_step_when_asked(run, capsys):
    """--regenerate adds the step before extraction: generated tokens from the stated answer length or
    the dataset's own answers, wall time and GPU-hours from one server's decode rate."""
    out = run_json(capsys, REF + ["--regenerate", "--answer-tokens", "500", "--generate-tokens-per-s", "5000",
                                  "--gpus", "16", "--gpus-per-server", "2"])
    regen = out["regeneration"]
    assert regen["tokens"] == 913_786 * 500 and regen["servers"] == 8
    assert regen["wall_s"] == pytest.approx(913_786 * 500 / (5000 * 8))
    assert regen["gpu_hours"] == pytest.approx(913_786 * 500 / 5000 / 3600 * 2)
    assert "regeneration" not in run_json(capsys, REF)

    # Measured: the dataset's assistant tokens per sample, counted by the extractor's own tokenizer.
    measured = run_json(capsys, ["estimate", *run["args"], "--regenerate", "--token-sample", "0"])["regeneration"]
    from layertap.extract.inputs import TokenizeStats, load_rows, tokenize_rows
    from transformers import AutoTokenizer

    model, data = run["args"][1], run["args"][3]
    stats = TokenizeStats()
    list(tokenize_rows(load_rows(data), AutoTokenizer.from_pretrained(model), 48, stats=stats))
    assert measured["answer_tokens"] == pytest.approx(stats.answer_tokens / stats.samples)
    # every chat with a user turn is answered: the prompt-only row of write_chats too (it counted the samples)
    assert measured["samples"] == stats.prompted == stats.samples + 1 and measured["wall_s"] is None
    # the answers' own length, not what --max-length keeps of them: a regenerated answer is not cut there
    args = [a if a != "48" else "24" for a in run["args"]]
    short = run_json(capsys, ["estimate", *args, "--regenerate", "--token-sample", "0"])["regeneration"]
    cut = TokenizeStats()
    list(tokenize_rows(load_rows(data), AutoTokenizer.from_pretrained(model), 24, stats=cut))
    assert cut.truncated and cut.supervised_tokens < cut.answer_tokens
    assert short["answer_tokens"] == pytest.approx(cut.answer_tokens / cut.samples)

    assert cli(REF + ["--regenerate"]) == 2
    assert "--answer-tokens" in capsys.readouterr().err
    prompts = run["root"] / "prompts.jsonl"  # nothing answered yet: the extraction after it is stated, not guessed
    prompts.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"q {i}?"}]}) + "\n"
                               for i in range(5)))
    args = [a if a != data else str(prompts) for a in run["args"]]
    assert cli(["estimate", *args, "--regenerate", "--answer-tokens", "500"]) == 2
    assert "the dataset's rows hold prompts and no answers" in capsys.readouterr().err
    assert cli(REF + ["--generate-tokens-per-s", "10"]) == 2
    assert "add --regenerate" in capsys.readouterr().err


def test_impossible_stated_values_are_refused_naming_the_flag(capsys):
    cases = [
        # extraction truncates at --max-length: a longer mean would estimate bytes that are never stored
        (["estimate", "--hidden-size", "5120", "--num-layers", "64", "--samples", "10", "--mean-tokens", "5000",
          "--max-length", "4096"], "--mean-tokens 5000 is above --max-length 4096"),
        (REF + ["--regenerate", "--answer-tokens", "500", "--gpus-per-server", "0"],
         "--gpus-per-server must be at least 1, got 0"),  # was a ZeroDivisionError
        (REF + ["--regenerate", "--answer-tokens", "500", "--servers", "0"], "--servers must be at least 1, got 0"),
        # a kept sample has two consecutive supervised tokens: no run's mean is under 2
        (["estimate", "--hidden-size", "64", "--num-layers", "4", "--samples", "10", "--mean-tokens", "0.5"],
         "--mean-tokens 0.5 is under 2"),
    ]
    for args, message in cases:
        assert cli(args) == 2, args
        assert message in capsys.readouterr().err, (args, message)


def test_plan_of_an_existing_run_shows_the_runs_own_shards(run, tmp_path, capsys, caplog):
    """The plan is fixed when the run is created: another --shard-bytes is warned about, and the
    report (shards, shard size, estimate) is the run's, not a cut that will never be used."""
    out = str(tmp_path / "planned")
    first = run_json(capsys, ["plan", *run["args"], "--out", out])
    assert first["written"] and first["shard_bytes_target"] == 64_000
    args = [a if a != "64KB" else "16KB" for a in run["args"]]
    fresh = run_json(capsys, ["plan", *args, "--dry-run"])  # no --out: the new cut
    assert fresh["shards"] > first["shards"]

    again = run_json(capsys, ["plan", *args, "--out", out, "--dry-run"])
    assert again["existing_run"] and again["shards"] == first["shards"] == len(load_manifest(open_store(out)).shards)
    assert again["shard_bytes_target"] == 64_000 and again["estimate"]["shards"] == first["shards"]
    assert again["bytes_per_shard_stored"] == first["bytes_per_shard_stored"]
    assert "keeps its plan of" in caplog.text and "applies only to a new run" in caplog.text
    assert cli(["plan", *args, "--out", out, "--dry-run"]) == 0
    assert f"{first['shards']} shards cut at 64,000 B" in capsys.readouterr().out
    # without --shard-bytes there is nothing to warn of: every rerun was told of a 1 GB it never asked for
    caplog.clear()
    unsized = [a for i, a in enumerate(run["args"]) if "--shard-bytes" not in (a, run["args"][i - 1] if i else "")]
    assert len(unsized) == len(run["args"]) - 2
    assert run_json(capsys, ["plan", *unsized, "--out", out, "--dry-run"])["shards"] == first["shards"]
    assert "applies only to a new run" not in caplog.text
    # estimate does not use --out: it says so where --out names a planned run, whose own plan extract resumes
    assert cli(["estimate", *args, "--out", out]) == 0
    run_id = load_manifest(open_store(out)).run_id
    assert f"note: {out} holds run {run_id}, planned already ({first['shards']} shards cut at 64,000 B): this " \
        "estimates a new plan" in capsys.readouterr().err
    assert cli(["estimate", *args, "--out", str(tmp_path / "nothing-there")]) == 0
    assert "note:" not in capsys.readouterr().err


def test_measure_batches_the_samples_as_the_planned_shards_hold_them():
    """--measure ran every measured sample through one shard: 16 samples in batches of 16, where
    the run's 2 MB shards hold 2 each and a worker batches within a shard. Its tokens/s was 3x
    what the extraction then ran at. The forwards are the planned shards' now."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from layertap.extract.inputs import TokenizedSample
    from layertap.extract.measure import measure_extraction
    from layertap.extract.model import Capture
    from layertap.storage.format import ShardMeta

    config = AutoConfig.for_model("llama", hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                  num_attention_heads=2, num_key_value_heads=1, vocab_size=128)
    torch.manual_seed(0)
    capture = Capture(AutoModelForCausalLM.from_config(config).eval().requires_grad_(False), [1, 2])
    rows = []

    class Counted:  # the real capture, its batches' rows counted
        decoder = capture.decoder

        def __call__(self, ids, mask):
            rows.append(ids.shape[0])
            return capture(ids, mask)

    samples = [TokenizedSample(f"s{i}", torch.randint(1, 128, (64,)), torch.ones(64, dtype=torch.bool)) for i in range(16)]
    meta = ShardMeta(run_id="0" * 12, shard_id=0, model="m", layers=[1, 2], hidden_size=32, codec="bf16-zstd")
    measure_extraction(Counted(), samples, meta, batch_tokens=4096, pad_id=0, encode_threads=1,
                       bytes_per_token=100.0, shard_bytes=2 * 64 * 100)  # 2 samples a shard
    assert rows[1:] == [2] * 8  # after the warm-up: 8 shards of 2, each its own batch
    rows.clear()
    measure_extraction(Counted(), samples, meta, batch_tokens=4096, pad_id=0, encode_threads=1)
    assert rows[1:] == [16]  # no plan given: one shard, as before
    # a worker tokenizes each shard's rows before its forwards: the time the picks took counts in the wall
    m = measure_extraction(capture, samples, meta, batch_tokens=4096, pad_id=0, encode_threads=1, tokenize_s=1000.0)
    assert 1000.0 < m.wall_s and m.tokens_per_s == m.tokens / m.wall_s < m.tokens / 1000.0


def test_extrapolated_tokens_keep_the_mean_of_the_samples_read():
    """Samples and tokens were extrapolated and rounded apart: 1 sample of 64 tokens in 3 rows read of
    40 gave 13 samples of 853 tokens, a mean of 65.6 at --max-length 64."""
    from layertap.extract.measure import TokenStats

    stats = TokenStats(rows=40, rows_read=3, samples_read=1, tokens_read=64)
    assert (stats.samples, stats.tokens) == (13, 13 * 64)
    exact = TokenStats(rows=40, rows_read=40, samples_read=13, tokens_read=800)
    assert (exact.samples, exact.tokens) == (13, 800)
