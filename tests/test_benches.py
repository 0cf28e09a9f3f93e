"""The benchmark scripts stay runnable: bench/gpu_extract.py is run on a tiny config on CPU, so it
is ready for the day an H200 is available."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run_bench(script: str, *args: str, timeout: float = 600, **kw) -> subprocess.CompletedProcess:
    """bench/`script` run as a user runs it; it must exit 0 (else the tails of its output say why)."""
    p = subprocess.run([sys.executable, str(REPO / "bench" / script), *args], capture_output=True, text=True,
                       timeout=timeout, **kw)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p


@pytest.mark.slow
def test_gpu_extract_runs_on_a_tiny_config(tmp_path):
    """Both halves of the device step: the fp32 reference from one process, then the variants,
    their errors against it, the profile and the pipeline from another."""
    ref, out = tmp_path / "ref.safetensors", tmp_path / "gx.json"
    run_bench("gpu_extract.py", "--tiny", "--batches", "1", "--reference-out", str(ref), "--json", str(tmp_path / "ref.json"))
    run_bench("gpu_extract.py", "--tiny", "--batches", "2", "--variants", "eager,conv,norms,fused,split,tokens32k",
              "--reference-in", str(ref), "--pipeline", "--profile", "--json", str(out))
    r = json.loads(out.read_text())
    assert r["kept_layers"] == 6 and r["tokens"] > 0  # layers after the last capture layer are dropped
    assert "chunk_gated_delta_rule=fallback (torch reference)" in r["kernels"]["linear_attention"]
    assert r["variants"]["conv"] == {"skipped": "fla's short convolution is not available here"}
    for name in ("eager", "norms", "fused", "split", "tokens32k"):  # fp32 on CPU: the reference forward's numbers
        assert max(r["variants"][name]["rel_error"]) < 1e-5
    assert any(k.startswith("rms_norm=fast (torch.compile") for k in r["variants"]["norms"]["kernels"]["linear_attention"])
    assert r["variants"]["tokens32k"]["batch_tokens"] == 2 * r["batch_tokens"]
    assert r["variants"]["fused"]["fused_projection_groups"] > 0 == r["variants"]["norms"]["fused_projection_groups"]
    assert r["variants"]["split"]["split_conv_layers"] > 0 == r["variants"]["fused"]["split_conv_layers"]
    assert r["bare"]["variant"] in ("eager", "norms", "fused", "split") and r["profile_top"]
    assert r["matmul_ceiling"]["kept_layers_s"] > 0 and r["matmul_ceiling"]["fused_kept_layers_s"] > 0
    for way in ("local", "s3"):
        assert r[way]["bytes"] > 0 and r[way]["ratio"] > 1.0 and r[way]["vs_bare"] > 0
        assert 0 < r[way]["to_last_forward_s"] <= r[way]["s"] and r[way]["drain_s"] >= 0  # split at the last forward
        assert abs(r[way]["to_last_forward_s"] + r[way]["drain_s"] - r[way]["s"]) < 1e-6 and r[way]["steady_vs_bare"] > 0
        assert {"forward_s", "copy_s", "encode_s_summed", "write_s", "close_s"} <= set(r[way])
        # on one clock: the bare loop's forwards timed as the pipeline times its own (not its wall time)
        assert 0 < r[way]["forward_vs_bare"] == r[way]["forward_s"] / r["pipeline_bare"]["forward_s"]
    assert 0 < r["pipeline_bare"]["forward_s"] <= r["pipeline_bare"]["s"]
    for way in ("local_shards", "local_shards_serial", "s3_shards", "s3_shards_serial"):
        assert r[way]["shards"] == 2 and r[way]["vs_bare"] > 0  # 2 batches, one per shard: each committed
    assert r["local_shards"]["rounds"] == r["local_shards_serial"]["rounds"] == 2  # both rounds counted, none failed
    other = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_extract.py"), "--tiny", "--batches", "1", "--seq", "32", "--reference-in",
                            str(ref)], capture_output=True, text=True, timeout=600)
    assert other.returncode != 0  # a reference of other inputs or weights is refused, not compared


@pytest.mark.slow
def test_gpu_extract_lean_rows_are_what_the_device_step_runs(tmp_path):
    """bench/device_checks.sh's extract step by default: the short conv, the fused norms and the fused
    projections, and the lean pipeline rows (no serial or S3-shards comparison rows, which cost ~50 s of a device session)."""
    out = tmp_path / "gx.json"
    run_bench("gpu_extract.py", "--tiny", "--batches", "2", "--variants", "conv,norms,fused,split", "--pipeline",
              "--pipeline-rows", "lean", "--json", str(out))
    r = json.loads(out.read_text())
    assert set(r["variants"]) == {"conv", "norms", "fused", "split"} and r["bare"]["variant"] in ("norms", "fused", "split")
    assert r["pipeline_rows"] == "lean"
    assert r["local"]["vs_bare"] > 0 and r["s3"]["vs_bare"] > 0 and r["local_shards"]["shards"] == 2
    assert not {"local_shards_serial", "s3_shards", "s3_shards_serial"} & set(r)


def test_drafter_build_bench_times_both_ways(tmp_path):
    out = tmp_path / "db.json"
    run_bench("drafter_build.py", "--tiny", "--vocab", "256", "--json", str(out))
    r = json.loads(out.read_text())
    assert r["default-init_s"] > 0 and r["drafter_s"] > 0 and r["trainable_params"] > 0 and r["ratio"] > 0


@pytest.mark.slow
def test_gpu_train_runs_on_a_tiny_config(tmp_path):
    out = tmp_path / "gt.json"
    run_bench("gpu_train.py", "--tiny", "--steps", "2", "--json", str(out))
    r = json.loads(out.read_text())
    assert r["tokens_per_s"] > 0 and r["drafter_params"] > 0 and r["loss"] > 0


@pytest.mark.slow
def test_loader_vs_mds_runs_and_says_when_mds_is_missing(tmp_path):
    """The MosaicML side needs its own virtualenv; without it the bench still measures layertap."""
    p = run_bench("loader_vs_mds.py", "--mb", "4", "--rounds", "1", "--mds-python", str(tmp_path / "no-venv" / "python"),
                  env=dict(os.environ, BENCH_CACHE_DIR=str(tmp_path)))
    assert "MDS rows are skipped" in p.stdout and "| layertap loader |" in p.stdout
    assert "| 0 MB | 0 MB |" in p.stdout  # nothing written locally, no cache


def test_page_faults_bench_shows_the_malloc_settings_keep_big_buffers_mapped():
    """docs/LOADER.md's claim on this machine's glibc: under the MALLOC_* settings a freed 47 MiB
    buffer is reused, not mapped and page-faulted in again."""
    p = run_bench("page_faults.py", "--rounds", "4", timeout=300, cwd=REPO)
    faults = {}
    for line in p.stdout.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 5 and cells[1].startswith("47 MiB"):
            faults[cells[0]] = float(cells[4].replace(",", ""))
    pages = (47 << 20) // 4096
    assert faults["glibc defaults"] > 0.9 * pages  # every buffer faulted in afresh
    assert faults["MALLOC_* settings"] < 0.5 * pages  # the first one only, spread over the rounds


def test_moto_s3_pace_caps_each_connection():
    """bench/loader.py --conn-mbps models S3's per-connection rate with a paced moto server: a
    2 MB GET at 4 MB/s cannot take less than ~0.5 s, and the bytes still arrive whole."""
    import time

    import boto3

    from tests.s3server import start_moto_server, stop

    proc, url = start_moto_server(conn_mbps=4)
    try:
        s3 = boto3.client("s3", endpoint_url=url, region_name="us-east-1",
                          aws_access_key_id="k", aws_secret_access_key="s")
        s3.create_bucket(Bucket="paced")
        body = os.urandom(2_000_000)
        s3.put_object(Bucket="paced", Key="k", Body=body)
        t = time.perf_counter()
        got = s3.get_object(Bucket="paced", Key="k")["Body"].read()
        elapsed = time.perf_counter() - t
    finally:
        stop(proc)
    assert got == body
    assert elapsed >= 0.4, f"a 2 MB GET at 4 MB/s took {elapsed:.2f} s: the connection was not paced"


@pytest.mark.slow
def test_gpu_train_cli_bench_runs_the_real_command_on_a_tiny_config(tmp_path):
    """bench/gpu_train_cli.py: two `layertap train` runs streaming synthetic runs from its own moto
    server, summarised from the trainer's metrics into the JSON the GPU run commits."""
    out = tmp_path / "gtc.json"
    p = run_bench("gpu_train_cli.py", "--tiny", "--json", str(out))
    r = json.loads(out.read_text())
    assert {"device", "date", "tokens_per_s", "data_wait_median", "peak_gib", "step_s_median"} <= set(r)
    for run in (r["qwen27b"], r["small"]):
        assert run["rc"] == 0 and run["steps"] == 6 and run["tokens_per_s"] > 0
        assert 0 <= run["data_wait_median"] <= 1 and run["step_s_median"] > 0
        assert run["run"]["samples"] == 8 and 0 < run["run"]["stored_bytes"] < run["run"]["raw_bytes"]  # bf16-zstd
    assert r["tokens_per_s"] == r["qwen27b"]["tokens_per_s"] and r["small"]["drafter_layers"] == 1
    assert r["qwen27b"]["capture_layers"] == [1, 3, 5] and len(r["small"]["capture_layers"]) == 4
    assert "27b | " in p.stdout and "small | " in p.stdout  # the trainer's own lines, with the bench's clock
    assert "| **data wait, median** (max) |" in run_bench("gpu_train_cli.py", "--report", str(out), timeout=120).stdout


@pytest.mark.slow
def test_follow_bench_runs_the_three_modes_on_a_tiny_run(tmp_path):
    """bench/follow.py --tiny: real paced `layertap extract` and `layertap train` processes on its own
    moto server, extract-then-train, follow and follow + window, the same steps in each."""
    out = tmp_path / "follow.json"
    run_bench("follow.py", "--tiny", "--json", str(out), timeout=900)
    r = json.loads(out.read_text())
    assert r["ok"] and r["same_steps"] and r["window_peak_under_bound"]
    modes = r["modes"]
    assert {m["steps"] for m in modes.values()} == {24} and all(m["train_rc"] == m["extract_rc"] == 0
                                                                  for m in modes.values())
    whole = modes["extract_then_train"]["peak_bytes_at_rest"]
    assert whole == r["run"]["bytes"] == modes["follow"]["peak_bytes_at_rest"]  # nothing deleted without a window
    assert modes["follow_window"]["peak_bytes_at_rest"] < whole and modes["follow_window"]["final_bytes_at_rest"] == 0
    assert modes["follow"]["vs_extract_then_train"] > 0 and 0 <= modes["follow"]["data_wait_fraction"] <= 1
    assert "| train --follow |" in run_bench("follow.py", "--report", str(out), timeout=120).stdout


def test_follow_decode_bench_reads_every_mode_over_a_finished_run(tmp_path):
    """bench/follow_decode.py over a run of the fake worker (real shards and commits in a folder):
    every mode reads the samples asked for, and the report gives each a rate and a ratio."""
    from tests import fake_worker

    fake_worker.work(str(tmp_path / "run"), samples=40)
    out = tmp_path / "decode.json"
    run_bench("follow_decode.py", "--run", str(tmp_path / "run"), "--samples", "30", "--rounds", "2",
              "--shuffle-buffer", "8", "--json", str(out), timeout=300, env=dict(os.environ, PYTHONPATH=str(REPO)))
    r = json.loads(out.read_text())
    assert set(r["passes"]) == set(r["decoded_mb_per_s_median"]) and len(r["passes"]) == 3
    assert all(len(v) == 2 and all(x["samples"] == 30 and x["decoded_mb_per_s"] > 0 for x in v)
               for v in r["passes"].values())
    assert r["vs_consumer_thread"]["follow, decode on the consumer's thread"] == 1.0


@pytest.mark.parametrize("mode", [["--consumers", "3"], ["--consumers", "3", "--first-looks"]])
def test_follow_looks_bench_runs_on_a_tiny_run(mode):
    """bench/follow_looks.py (its own moto server): consumers of a follow epoch waiting on a worker's
    commits, or their first looks at a run; every consumer here has a share of every shard (36
    samples a shard, 3 consumers), so each reads every commit record once."""
    p = run_bench("follow_looks.py", "--samples", "3000", "--committed", "10", "--every", "0.2", "--seconds", "3", *mode,
                  timeout=300, env=dict(os.environ, PYTHONPATH=str(REPO)))
    table = [line for line in p.stdout.splitlines() if line.startswith("| ") and not line.startswith("| ---")]
    assert len(table) == 2, p.stdout[-3000:]  # a header and its one row
    if "--first-looks" not in mode:
        assert "| 1.000 |" in table[1]  # GETs per commit a consumer finds


@pytest.mark.slow
def test_recipe_bench_runs_both_codecs_side_by_side_and_writes_what_issue_24_asks(tmp_path):
    """bench/train_dflash.py (the device `recipe` step runs it): the real SmolLM2 and ShareGPT, a few
    samples and steps; each codec extracted and trained at once, tau at every kept checkpoint of the
    lossless drafter and at the last of the fp8 one, and the JSON the issue names."""
    out, png = tmp_path / "train_dflash.json", tmp_path / "curve.png"
    run_bench("train_dflash.py", "--work", str(tmp_path / "work"),
              "--limit", "12", "--steps", "4", "--every", "2", "--prompts", "1", "--max-new-tokens", "6",
              # fp32 extraction and training (the recipe's bf16 autocast, given after `--`, is overridden):
              # bf16 on a CPU without native bf16 (CI's machines) is several times slower; the
              # whole bench took 8.6 min alone with the recipe's bf16 training, 2.1 min without
              "--dtype", "float32", "--max-length", "256", "--side-by-side", "--json", str(out), "--png", str(png),
              "--", "--mixed-precision", "no", timeout=900, env=dict(os.environ, OMP_NUM_THREADS="1"))
    r = json.loads(out.read_text())
    assert {"tau", "tau_untrained", "matches_greedy", "steps", "samples", "recipe"} <= set(r)
    assert r["steps"] == 4 and r["samples"] == r["codecs"]["bf16-zstd"]["samples"] > 0 and r["matches_greedy"] is True
    assert "--steps" in r["recipe"]["train_args"] and r["recipe"]["final_state"] == "prenorm"
    assert r["recipe"]["train_args"][-2:] == ["--mixed-precision", "no"]  # what was run, recorded
    lossless, fp8 = r["codecs"]["bf16-zstd"], r["codecs"]["fp8"]
    assert [c["step"] for c in lossless["curve"]] == [2, 4] and [c["step"] for c in fp8["curve"]] == [4]
    assert fp8["bytes_stored"] < lossless["bytes_stored"] and fp8["samples"] == lossless["samples"]
    assert fp8["tau_vs_lossless"] == pytest.approx(fp8["curve"][-1]["tau"] / r["tau"])
    assert png.stat().st_size > 10_000


def test_block_mask_bench_runs_and_its_masks_agree(tmp_path):
    """bench/block_mask.py on tiny shapes: the tiled mask and create_block_mask's, equal per batch."""
    out = tmp_path / "bm.json"
    run_bench("block_mask.py", "--tiny", "--ways", "tiled,eager", "--json", str(out))
    r = json.loads(out.read_text())
    assert r["equal"] is True and set(r["ways"]) == {"tiled", "eager"}
    assert len(r["ways"]["tiled"]["seconds"]) == len(r["batches"]) == 3


def test_work_scale_bench_counts_each_pair_side_by_side(tmp_path):
    out = tmp_path / "ws.json"
    run_bench("work_scale.py", "--shards", "2500", "--leased", "20", "--tasks", "50", "--json", str(out))
    r = json.loads(out.read_text())
    passes, rank = r["worker_pass"], r["trainer_rank_start"]
    # 2,250 commits: the full scan lists them (3 pages), the look between full looks only the feed since
    assert passes["full scan (every pass before)"]["LIST pages"] > passes["CommitView between full looks"]["LIST pages"]
    assert rank["takes rank 0's (committed=)"] == {"s": rank["takes rank 0's (committed=)"]["s"], "GET": 1}
    assert rank["reads the commits itself (before)"]["LIST pages"] >= 3
    assert r["submit_queued_static"]["tasks"] == 50 and r["command"].startswith("python bench/work_scale.py")
    ids, digests = r["rank_holds"]["every sample id (before)"], r["rank_holds"]["a digest of each shard's ids"]
    assert 0 < digests["json_MiB"] < ids["json_MiB"] and 0 < digests["held_MiB"] < ids["held_MiB"]
