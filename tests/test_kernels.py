"""The kernel line as a user meets it: `layertap extract` on a hybrid target names its kernels."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tiny_models import tiny_model_dir

REPO = Path(__file__).resolve().parents[1]


def test_extract_on_a_hybrid_target_logs_its_kernel_path(tmp_path):
    model = tiny_model_dir(tmp_path, "qwen3_5_text", 4)
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"q{i}?"},
                                                     {"role": "assistant", "content": "an answer " * (i + 1)}]}) + "\n"
                            for i in range(3)))
    p = subprocess.run([sys.executable, "-m", "extract.cli", "extract", "--model", model, "--dataset", str(data),
                        "--out", str(tmp_path / "run"), "--layers", "1,3", "--dtype", "float32",
                        "--max-length", "64", "--log-dir", str(tmp_path / "logs")],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path,
                       env=dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1"))
    assert p.returncode == 0, p.stderr[-3000:]
    lines = [line for line in p.stderr.splitlines() if "kernels:" in line]
    assert len(lines) == 1, p.stderr[-3000:]  # one line, at the start, before any shard
    assert "linear_attention x3: " in lines[0] and "chunk_gated_delta_rule=" in lines[0]
    assert "full_attention x1: attention=sdpa" in lines[0]
    assert p.stderr.index("kernels:") < p.stderr.index("committed")
