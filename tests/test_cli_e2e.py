"""bench/cli_e2e.py, the GPU host's end-to-end step, on CPU at small sizes: the real `layertap`
commands over a random-init `qwen3_5_text` target with SmolLM2's tokenizer and ShareGPT rows,
against the session's S3 server."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench" / "cli_e2e.py"


@pytest.mark.slow
def test_cli_end_to_end_on_a_hybrid_target(tmp_path, s3_endpoint):
    prepared = tmp_path / "e2e"
    p = subprocess.run([sys.executable, str(SCRIPT), "--prepare", str(prepared), "--hidden", "64",
                        "--conversations", "16", "--held-out", "1"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    size = sum(f.stat().st_size for f in prepared.rglob("*") if f.is_file())
    assert size < 8e6  # it is carried to the GPU host
    assert json.loads((prepared / "target" / "config.json").read_text())["vocab_size"] == 49152  # SmolLM2's

    out = tmp_path / "out" / "e2e.json"
    p = subprocess.run([sys.executable, str(SCRIPT), str(prepared), "--json", str(out), "--endpoint", s3_endpoint,
                        "--max-length", "256", "--shard-bytes", "256KB", "--steps", "8", "--batch-size", "2",
                        "--max-anchors", "16", "--prompts", "1", "--max-new-tokens", "8"],
                       capture_output=True, text=True, timeout=600)
    report = json.loads(out.read_text())
    steps = {s["name"]: s for s in report["steps"]}
    assert list(steps) == ["extract", "status", "status_json", "verify", "inspect", "train", "eval"], p.stdout[-3000:]
    assert report["target"]["layer_types"] == ["full_attention", "linear_attention"]
    for name in ("extract", "status", "status_json", "verify", "inspect", "train"):
        assert steps[name]["ok"] and steps[name]["rc"] == 0, (name, steps[name].get("problems"),
                                                              steps[name].get("stderr_tail"))
    assert steps["status_json"]["complete"] and steps["status_json"]["shards_done"] > 1
    assert steps["extract"]["shards"] == f"{steps['status_json']['shards_done']}/{steps['status_json']['shards_total']}"
    assert steps["verify"]["checked"] == steps["status_json"]["shards_done"] and steps["verify"]["bad"] == 0
    assert steps["inspect"]["produced_on"] == "cpu" and "linear_attention" in steps["inspect"]["kernels_recorded"]
    assert steps["train"]["steps"] == 8 and steps["train"]["loss_final"] < steps["train"]["loss_first"]
    assert (out.parent / "e2e-logs" / "train.err").exists()
    assert "$TARGET" in steps["train"]["cmd"] and str(tmp_path) not in json.dumps(report["steps"])  # portable commands

    doc = subprocess.run([sys.executable, str(SCRIPT), "--report", str(out)], capture_output=True, text=True,
                         timeout=60, cwd=REPO)  # the docs section, printed only (no --write-docs)
    assert doc.returncode == 0, doc.stderr
    assert all(f"| {name} | `layertap" in doc.stdout for name in steps)
    assert ("Every step passed" if report["ok"] else "Failed: eval") in doc.stdout

    ev = steps["eval"]
    if ev["ok"]:
        assert ev["rc"] == 0 and ev["tau"] >= 1.0 and ev["matches_greedy"] is True
        assert report["ok"] and p.returncode == 0
    else:  # the refusal of linear-attention targets, recorded as it is
        assert ev["rc"] == 2 and "attention-only" in ev["message"], ev
        assert not report["ok"] and p.returncode == 1
