#!/usr/bin/env bash
# Prepares, on the dev machine, what bench/device_checks.sh needs on the GPU machine, which has
# no package index and no SmolLM2: run once from the repo root, then carry .whl and .devcache.
#   .whl/       wheels its image lacks, for its Python 3.12 (its torch, transformers, numpy,
#               xxhash, safetensors, werkzeug, click... are already there)
#   .whl/fla/   flash-linear-attention and fla-core (installed apart, so one step can run without them)
#   .devcache/  tests/activations.py's cached SmolLM2 activations (computed here if missing), and
#               e2e/: the small qwen3_5_text target and ShareGPT rows of bench/cli_e2e.py
set -euo pipefail
exclude=$(git rev-parse --git-path info/exclude)  # .git/info/exclude, also from a worktree (.git a file)
mkdir -p "$(dirname "$exclude")"
grep -qx '/.whl/' "$exclude" || echo /.whl/ >>"$exclude"
grep -qx '/.devcache/' "$exclude" || echo /.devcache/ >>"$exclude"
grep -qxF '/.whl.*' "$exclude" || echo '/.whl.*' >>"$exclude"  # the download's temp folders: never carried
platforms=()
for p in manylinux_2_34 manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014 manylinux1; do
    platforms+=(--platform "${p}_x86_64")
done
# the same versions as here; transformers too (the image's 5.17 differs in the hybrid caches), and
# datasets with the two packages of its own that the image lacks
wanted=(boto3 botocore s3transfer jmespath moto responses xmltodict cryptography cffi pycparser
    flask flask-cors blinker itsdangerous zstandard transformers regex datasets dill multiprocess)
# and, where installed here, what transformers checks at import beyond the image's versions:
# transformers 5.25 wants huggingface-hub 2.x, which brings httpx2 (the image's hub 1.33 stopped
# every step on 2026-12-04); an older transformers here goes with an older hub and needs none
optional=(tokenizers safetensors huggingface-hub hf-xet httpx2 httpcore2 truststore h11)
pins=$(python -m pip show "${wanted[@]}" 2>/dev/null | awk '/^Name:/{n=$2} /^Version:/{print n"=="$2}')
# pip show exits 0 with a package missing: one not installed here would be absent from .whl, silently
if [ "$(wc -w <<<"$pins")" != "${#wanted[@]}" ]; then
    echo "device_prep: not installed here, so no wheel to pin: $(comm -23 <(printf '%s\n' "${wanted[@]}" | tr A-Z_ a-z- \
        | sort) <(sed 's/==.*//' <<<"$pins" | tr A-Z_ a-z- | sort) | xargs)" >&2
    exit 1
fi
pins="$pins $(python -m pip show "${optional[@]}" 2>/dev/null | awk '/^Name:/{n=$2} /^Version:/{print n"=="$2}')"
# One version of each wheel in .whl (two stop the install there), so a fresh folder: downloaded
# beside it first and swapped in only when complete, so that a failed download (no network, a pin
# without a wheel for 3.12) leaves the last good .whl in place.
new_whl=$(mktemp -d .whl.new.XXXXXX)
trap 'rm -rf "$new_whl"' EXIT
python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d "$new_whl" $pins
python -m pip download -q --no-deps --only-binary=:all: -d "$new_whl/fla" flash-linear-attention==0.6.0 fla-core==0.6.0
rm -rf .whl.old
[ ! -d .whl ] || mv .whl .whl.old
mv "$new_whl" .whl
rm -rf .whl.old
python -c "
import sys; sys.path.insert(0, '.')
from tests.activations import smollm2_activations; smollm2_activations(16, 256)"
mkdir -p .devcache
cp "${LAYERTAP_TEST_CACHE:-$HOME/.cache/layertap-tests}"/smollm2-v1-n16-t256-l1_8_15_22_27.safetensors .devcache/
[ -d .devcache/e2e ] || python bench/cli_e2e.py --prepare .devcache/e2e
du -sh .whl .devcache
# a device call carries at most 64 MiB, the working tree (tracked and untracked, not ignored files)
# included: .whl and .devcache/e2e go together with it in the plan's first call
tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 du -cb 2>/dev/null | awk '$2 == "total" {s += $1} END {print s + 0}')
extra=$(du -cb .whl .devcache/e2e | tail -1 | cut -f1)
carried=$(((tree + extra) * 100 / 1048576))  # hundredths of a MiB
say="a call carrying .whl and .devcache/e2e takes $((carried / 100)).$(printf %02d $((carried % 100))) MiB of the 64"
if [ "$carried" -ge 6400 ]; then
    echo "device_prep: $say: over; remove untracked files from the tree or wheels the GPU image has from .whl" >&2
    exit 1
fi
[ "$carried" -lt 6200 ] || echo "device_prep: $say: near the limit (an untracked file in the tree tips it over)" >&2
echo "device_prep: .whl and .devcache/e2e are ready (what bench/device_checks.sh's default steps need)"
# Issue 24's recipe step needs SmolLM2 and ShareGPT rows there, 98 MB + rows over the 64 MiB one call
# carries: three parts, each carried by one call of three in a row (a warm machine keeps the ignored
# paths earlier calls brought): .devcache/recipe-1 (the GGUF's first third + the wheels extraction
# needs beyond the image), recipe-2 (second third + transformers), recipe-3 (last third + the rows).
# Optional (only the `recipe` step uses it) and after what the plan needs: a failure here (gguf or
# zstandard missing here, no network) is reported, and the script still succeeds.
recipe_parts() {
rm -rf .devcache/recipe-1 .devcache/recipe-2 .devcache/recipe-3
mkdir -p .devcache/recipe-1 .devcache/recipe-2 .devcache/recipe-3
gguf=$(python -c "import os; from layertap.extract.embedded import smollm2_gguf; print(os.path.join(*smollm2_gguf()))")
for i in 1 2 3; do split -n "$i/3" "$gguf" >".devcache/recipe-$i/smollm2.gguf.part$i"; done
cp .whl/datasets-*.whl .whl/dill-*.whl .whl/multiprocess-*.whl .whl/zstandard-*.whl .devcache/recipe-1/
python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .devcache/recipe-1 "gguf==$(python -m pip show gguf | awk '/^Version:/{print $2}')"
cp .whl/transformers-*.whl .devcache/recipe-2/
python - <<'PY'
import json, zstandard
from layertap.extract.embedded import sharegpt_conversations
rows = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in sharegpt_conversations())
open(".devcache/recipe-3/sharegpt.jsonl.zst", "wb").write(zstandard.ZstdCompressor(level=19).compress(rows.encode()))
PY
du -sh .devcache/recipe-1 .devcache/recipe-2 .devcache/recipe-3
}
# In a subshell with `set -e`, run as a plain command: inside `if` or before `||` bash would ignore
# -e in the whole function, and a failed step would go on to the next. Its status is looked at here.
set +e
(set -e; recipe_parts)
recipe_rc=$?
set -e
if [ "$recipe_rc" -ne 0 ]; then
    rm -rf .devcache/recipe-1 .devcache/recipe-2 .devcache/recipe-3  # half-made parts would mislead the recipe step
    echo "device_prep: the optional recipe parts (.devcache/recipe-1..3) could not be made (rc $recipe_rc);" \
        "what device_checks.sh's default steps need is ready" >&2
fi
