"""The storage core, the shard format and the run manifest against Ceph radosgw: a real S3
implementation, where the rest of the suite talks to moto's emulation.

Their S3 cases run once more, in a pytest of their own whose every S3 request goes to a
radosgw started here (.ci/rgw.sh): conditional creates, multipart uploads and their abort,
ranged GETs, listings, and the commit and lease races between real processes. Skipped where
radosgw is not installed and cannot be (installing needs root).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # starts Ceph radosgw and reruns the S3 suites against it

ROOT = Path(__file__).resolve().parents[1]
RGW_SH = ROOT / ".ci" / "rgw.sh"
MODULES = ["tests/test_store.py", "tests/test_shard.py", "tests/test_manifest.py", "tests/test_commit_index.py"]


def _have_rgw() -> bool:
    return all(shutil.which(b) for b in ("radosgw", "ceph-mon", "ceph-osd", "radosgw-admin"))


@pytest.fixture(scope="module")
def rgw_env(tmp_path_factory) -> dict[str, str]:
    if not _have_rgw() and os.geteuid() == 0:
        subprocess.run(["bash", str(RGW_SH), "install"], check=False)
    if not _have_rgw():
        pytest.skip("Ceph radosgw is not installed and cannot be here (needs root and apt: `.ci/rgw.sh install`)")
    # A single-node Ceph started on a loaded CI machine has failed in ways of its own (a monitor
    # refusing commands for minutes): one more start, afresh in a new folder, before failing.
    failures = []
    for _ in range(2):
        folder = tmp_path_factory.mktemp("rgw")
        p = subprocess.run(["bash", str(RGW_SH), "start", str(folder)], capture_output=True, text=True, timeout=400)
        if p.returncode == 0:
            break
        failures.append(p.stdout + p.stderr)
        subprocess.run(["bash", str(RGW_SH), "stop", str(folder)], check=False)
    try:
        assert p.returncode == 0, "\n---\n".join(failures)
        if failures:
            warnings.warn(f"radosgw started on the second try; the first failed: {failures[0][-2000:]}")
        exports = dict(word.split("=", 1) for word in shlex.split(p.stdout.strip().splitlines()[-1])[1:])
        yield exports
    finally:
        subprocess.run(["bash", str(RGW_SH), "stop", str(folder)], check=False)


def test_store_shard_and_manifest_suites_pass_against_radosgw(rgw_env):
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")} | rgw_env
    # Their local-folder cases ran in the main suite already; every other case talks S3. Cases
    # marked moto_only add manifest logic, not S3 calls these do not make (~35 s of radosgw).
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", "-k", "not local",
                        "-m", "not moto_only", *MODULES],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    summary = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else ""
    assert p.returncode == 0, (p.stdout + p.stderr)[-6000:]
    passed = int(m.group(1)) if (m := re.search(r"(\d+) passed", summary)) else 0
    assert passed >= 65 and "skipped" not in summary, summary  # every S3 case ran, none skipped
