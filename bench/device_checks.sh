#!/usr/bin/env bash
# Every check that needs the GPU machine, in one run: a session is lent 15 device-minutes, and
# each machine start costs one or two of them. Each step has its own time limit and log, so one
# failing step still leaves the others' numbers.
#
#   bash bench/device_checks.sh OUTDIR [STEP ...]      (default: e2e ref extract train)
#
# As the device tool's command (carry [".whl", ".devcache/e2e"], timeout_s 600; the default steps
# take ~8 min on an H200 (2026-11-30: ref 31 s, extract 144 s, train > 170 s); a call brings back at most 8 files, hence the archive):
#   DEVICE_CHECKS_ARCHIVE=$OUT/dc.tgz bash bench/device_checks.sh /tmp/dc
# (the archive of every log and JSON is rewritten after each step, so a run cut at the call's
# limit still brings back what finished); then here: tar xzf dc.tgz, and record the JSONs (docs/bench/gpu_extract.json, gpu_train.json) and
# numbers (docs/benchmarks.md; bench/gpu_train_cli.py and bench/cli_e2e.py --report --write-docs).
#
# What it needs beside the repo (made by bench/device_prep.sh here; carry ".whl" and ".devcache/e2e",
# or ".devcache" whole for the loader steps: the 64 MiB a call carries fit the first pair, not all):
#   .whl/       wheels the GPU image lacks (boto3, moto[server], zstandard, transformers, ...) for its
#               Python; .whl/fla/ holds flash-linear-attention, installed apart (/tmp/fla) so that
#               the reference step runs on transformers' torch fallback
#   .devcache/  tests/activations.py's cached SmolLM2 activations (the loader bench's samples), and
#               e2e/ (bench/cli_e2e.py's target and rows), since SmolLM2 is not on that machine
# Steps (default: e2e ref extract train; e2e runs in the background beside ref):
#   e2e      bench/cli_e2e.py: the real CLI (extract -> status -> verify -> train -> eval) on a small
#            random qwen3_5_text target into moto on this host
#   ref      bench/gpu_extract.py without fla: the torch-fallback forward's speed and the fp32
#            reference states the fast kernels are compared with
#   extract  bench/gpu_extract.py with fla: eager, + fla's short convolution, 32k-token batches,
#            errors vs the reference, the top kernels, the pipeline into tmpfs and into moto
#   train    bench/gpu_train_cli.py: the real `layertap train` from moto at Qwen3.6-27B's shapes
#            and with a small drafter (data wait, tokens/s, peak memory)
#   compile  (only when named; answered 2026-11-30: compile loses to the fla short conv, 0.42 vs
#            0.50 MFU) bench/gpu_extract.py on 16 layers: eager vs torch.compile of each layer
#   loader   bench/loader.py at 1 GB, 5 rounds, on 16 cores: loader vs raw boto3 GETs (issue 5),
#            with 2, 4 and 8 decode threads beside the default
#   stages   (only when named) the loader's stages on bf16-zstd at 4 GB (passes of ~5 s, so the
#            first object's latency weighs less): fetch and checks alone, a 0.5 ms GIL switch
#            interval, 2 DataLoader workers: where a pass's time goes
#   malloc   (only when named) bench/page_faults.py, then bench/loader.py --stages at 1 GB under
#            the glibc settings the Slurm training jobs export (docs/LOADER.md, "Memory
#            allocator"), beside the same at defaults
#   writer   bench/writer.py: streaming writer vs boto3 upload_file, and moto's ingest ceiling there
#   step     bench/gpu_train.py: DFlash step at Qwen3.6-27B shapes; flex vs dense gradients
# DEVICE_CHECKS_TINY=1 runs the default steps' benches on tiny configs: a CPU rehearsal of this script.
set -u
tiny=${DEVICE_CHECKS_TINY:+--tiny}
out=${1:?usage: bench/device_checks.sh OUTDIR [STEP ...]}
shift
steps=${*:-e2e ref extract train}
mkdir -p "$out"
if [ -d .whl ] && [ -z "$tiny" ]; then  # wheels for the GPU host's Python (3.12)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH=/tmp/site
fi
if [ -d .whl/fla ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/fla .whl/fla/*.whl \
        || exit 1
fi
with_fla="env PYTHONPATH=/tmp/fla:${PYTHONPATH:-}"
export TRITON_CACHE_DIR=/tmp/triton-cache  # fla's kernels compile once for all the steps
export PYTHONUNBUFFERED=1 LAYERTAP_TEST_CACHE=$PWD/.devcache TOKENIZERS_PARALLELISM=false
{
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    nproc; free -g | head -2
    python3 -c "import torch, transformers, boto3, moto; print('torch', torch.__version__, 'transformers',
transformers.__version__, 'boto3', boto3.__version__, 'moto', moto.__version__)"
    $with_fla python3 -c "import fla; print('fla', fla.__version__)"
} >"$out/env.txt" 2>&1

step() {
    local name=$1 limit=$2
    shift 2
    [[ " $steps " == *" $name "* ]] || return 0
    local t0=$SECONDS
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    echo "step $name: rc=$? in $((SECONDS - t0)) s" | tee -a "$out/env.txt"
    archive
}

archive() {
    [ -n "${DEVICE_CHECKS_ARCHIVE:-}" ] || return 0
    local tmp="$DEVICE_CHECKS_ARCHIVE.$BASHPID"
    tar czf "$tmp" -C "$(dirname "$out")" "$(basename "$out")" && mv -f "$tmp" "$DEVICE_CHECKS_ARCHIVE"
}

# e2e beside ref: it is functional (a tiny model), ref's speed is only the known fallback's
if [[ " $steps " == *" e2e "* ]]; then
    step e2e 300 $with_fla python3 bench/cli_e2e.py .devcache/e2e --json "$out/cli_e2e.json" &
    e2e_pid=$!
fi
step ref 150 python3 bench/gpu_extract.py $tiny --variants eager --batches 2 --reference-out /tmp/ref.safetensors \
    --json "$out/gpu_extract_fallback.json"
[ -n "${e2e_pid:-}" ] && wait "$e2e_pid"
step extract 240 $with_fla python3 bench/gpu_extract.py $tiny --variants eager,conv,tokens32k --profile --pipeline \
    --reference-in /tmp/ref.safetensors --json "$out/gpu_extract.json"
step train 300 $with_fla python3 bench/gpu_train_cli.py $tiny --json "$out/gpu_train.json"
step compile 150 $with_fla python3 bench/gpu_extract.py $tiny --layers 1,15 --variants eager,conv,compile --batches 3 \
    --json "$out/gpu_extract_compile.json"
step loader 240 python3 bench/loader.py --rounds 5 --mb 1024 --decode-threads 2,4,8 --label gpu-host --write-docs
step stages 300 python3 bench/loader.py --rounds 3 --mb 4096 --codecs bf16-zstd --stages --workers 2 \
    --label gpu-host-stages --write-docs
# what the Slurm training jobs export: one source, slurm.scripts.MALLOC_SETTINGS
malloc_env=$(python3 -c 'from layertap.slurm.scripts import MALLOC_SETTINGS as m; print(*(f"{k}={v}" for k, v in m.items()))') \
    || exit 1
step malloc 300 bash -c 'python3 bench/page_faults.py --label gpu-host --write-docs && python3 bench/loader.py --rounds 3 --mb 1024 --stages --label gpu-host-malloc-defaults \
    --write-docs && env '"$malloc_env"' python3 bench/loader.py --rounds 3 --mb 1024 --stages --label gpu-host-malloc-tuned --write-docs'
step writer 120 python3 bench/writer.py --mb 256 --label gpu-host --write-docs
step step 150 python3 bench/gpu_train.py --json "$out/gpu_train_step.json"
cp docs/benchmarks.md "$out/benchmarks.md"
archive
