"""`kill -USR2` on a layertap command prints where every thread is, and the command goes on."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_sigusr2_prints_every_threads_stack_and_the_command_goes_on(tmp_path):
    # a follow trainer waiting for a run that does not exist yet: a command that waits, as a hung rank would
    p = subprocess.Popen([sys.executable, "-m", "layertap", "train", "--data", str(tmp_path / "run"), "--out",
                          str(tmp_path / "out"), "--follow", "--follow-poll-s", "0.5"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                         env=dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1"))
    try:
        deadline = time.monotonic() + 120
        lines: list[str] = []
        while time.monotonic() < deadline:  # waiting: it said so
            lines.append(p.stderr.readline())
            if "waiting" in lines[-1].lower() or p.poll() is not None:
                break
        assert p.poll() is None, "".join(lines) + p.stderr.read()
        p.send_signal(signal.SIGUSR2)
        time.sleep(3)
        assert p.poll() is None, "SIGUSR2 ended the command"  # the default action would have
        p.terminate()
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    dump = "".join(lines) + err
    assert "Current thread" in dump or "Thread 0x" in dump, dump[-3000:]
    assert 'File "' in dump and "follow" in dump  # the frames, down to where it waits


def test_main_called_in_process_under_a_captured_stderr_still_runs(capsys):
    """Tests and embedding hosts call the CLI in-process with sys.stderr replaced by an object
    without a file descriptor: the stack-dump handler must not stop the command there."""
    from layertap.cli import main

    assert main(["status", "s3://localhost:9000/bucket/run"]) == 2
    assert "is not a bucket name" in capsys.readouterr().err
