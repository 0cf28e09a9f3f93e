#!/usr/bin/env bash
# Every check that needs the GPU machine, in one run: a session is lent 15 device-minutes, and
# each machine start costs one or two of them. Each step has its own time limit and log, so one
# failing step still leaves the others' numbers.
#
#   bash bench/device_checks.sh OUTDIR [STEP ...]      (default: e2e ref extract train)
#
# As the device tool's command (carry [".whl", ".devcache/e2e"], timeout_s 600; a call brings back at
# most 8 files, hence the archive). The default steps no longer fit one 600 s call (2026-11-30 on an
# H200: ref 31 s, extract 144 s before the fused-norm variant and the multi-shard pipeline runs were
# added, train > 170 s, e2e > 200 s beside ref): make two calls in a row, the second within the
# machine's idle release (30 s) of the first so it stays warm:
#   DEVICE_CHECKS_ARCHIVE=$OUT/dc.tgz bash bench/device_checks.sh /tmp/dc e2e ref extract
#   DEVICE_CHECKS_ARCHIVE=$OUT/dc.tgz bash bench/device_checks.sh /tmp/dc train
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
#   extract  bench/gpu_extract.py with fla: eager, + fla's short convolution, + fused RMSNorms, 32k-token batches,
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
#   recipe   (only when named; issue 24) bench/train_dflash.py: the SmolLM2 drafter recipe, extraction,
#            training, tau along the run and the fp8 check. The machine lacks SmolLM2 and ShareGPT:
#            bench/device_prep.sh splits them over .devcache/recipe-1, -2 and -3 (< 64 MiB each), carried
#            by three calls in a row, each within the machine's idle release of the one before:
#              carry [".devcache/recipe-1"], command "true"; then [".devcache/recipe-2"], "true"; then
#              [".devcache/recipe-3"], "DEVICE_CHECKS_ARCHIVE=$OUT/dc.tgz bash bench/device_checks.sh /tmp/dc recipe"
#            RECIPE_ARGS replaces the bench's arguments, RECIPE_LIMIT_S its time limit (540 s); a rerun
#            on a warm machine continues the work in .devcache/recipe-work. The default sizes are a first guess,
#            not measured on a GPU (~6 M tokens, ~27 GB stored); the fp8 check is a second run with
#            RECIPE_ARGS naming the same settings and --codecs bf16-zstd,fp8
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
} >>"$out/env.txt" 2>&1  # appended: a second call (other steps) keeps the first one's lines

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
    step e2e 360 $with_fla python3 bench/cli_e2e.py .devcache/e2e --json "$out/cli_e2e.json" &
    e2e_pid=$!
fi
step ref 150 python3 bench/gpu_extract.py $tiny --variants eager --batches 2 --reference-out /tmp/ref.safetensors \
    --json "$out/gpu_extract_fallback.json"
[ -n "${e2e_pid:-}" ] && wait "$e2e_pid"
step extract 300 $with_fla python3 bench/gpu_extract.py $tiny --variants eager,conv,norms,tokens32k --profile --pipeline \
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
if [[ " $steps " == *" recipe "* ]]; then  # SmolLM2 and ShareGPT from .devcache/recipe-1..3
    recipe=(--work "$PWD/.devcache/recipe-work" --json "$out/train_dflash.json" --png "$out/train_curve_recipe.png")
    if [ -n "$tiny" ]; then  # the embedded SmolLM2 and ShareGPT of this machine, a few steps
        recipe+=(--limit 16 --steps 4 --every 2 --prompts 2 --max-new-tokens 8 ${RECIPE_ARGS:-})
    else
        mkdir -p /tmp/smollm2
        cat .devcache/recipe-1/smollm2.gguf.part1 .devcache/recipe-2/smollm2.gguf.part2 \
            .devcache/recipe-3/smollm2.gguf.part3 >/tmp/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf || exit 1
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-recipe \
            .devcache/recipe-1/*.whl .devcache/recipe-2/*.whl || exit 1
        export PYTHONPATH=/tmp/site-recipe:${PYTHONPATH:-}
        python3 -c "import sys, zstandard; sys.stdout.buffer.write(zstandard.decompress(open(sys.argv[1], 'rb').read(),
max_output_size=1 << 31))" .devcache/recipe-3/sharegpt.jsonl.zst >/tmp/sharegpt.jsonl || exit 1
        recipe+=(--model /tmp/smollm2 --gguf-file SmolLM2-135M-Instruct.Q4_1.gguf --dataset /tmp/sharegpt.jsonl
                 ${RECIPE_ARGS:---limit 10000 --max-length 1024 --epochs 3 --every 600 --codecs bf16-zstd -- --batch-size 16 --block-size 16 --max-anchors 256})
    fi
    step recipe "${RECIPE_LIMIT_S:-540}" python3 bench/train_dflash.py "${recipe[@]}"
fi
cp docs/benchmarks.md "$out/benchmarks.md"
archive
