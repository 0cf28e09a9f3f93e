#!/usr/bin/env bash
# Every check that needs the GPU machine: a session is lent 15 device-minutes in all (machine start
# included, one or two of them), at most 600 s a command, and only files under $OUT come back. Each
# step has its own time limit and log, so one failing step still leaves the others' numbers.
#
#   bash bench/device_checks.sh OUTDIR [STEP ...]      (default: ref extract e2e step train)
#
# Steps run in the order of the list below, whatever the order they are named in.
#
# The plan for one session (carry [".whl", ".devcache/e2e"] in BOTH calls: a machine released between
# them starts bare; made here first by bench/device_prep.sh):
#   call 1, timeout_s 360: the numbers issue 17 is decided by (MFU, local.vs_bare, numerics):
#     DEVICE_CHECKS_DEADLINE_S=340 DEVICE_CHECKS_ARCHIVE=$OUT/dc.tgz bash bench/device_checks.sh /tmp/dc ref extract
#   call 2 at once, on the warm machine, timeout_s from `status` (budget_left_s minus ~20 s for the transfers),
#   deadline 15 s under it: the CLI end to end (issue 17), then the DFlash step's memory and the 27B-shaped
#   training run (issue 18), each skipped (the reason recorded) when too little time is left for it:
#     TRAIN_ARGS="--only 27b --samples 16 --steps 24 --timeout-27b 95" DEVICE_CHECKS_DEADLINE_S=<timeout_s - 15> \
#       DEVICE_CHECKS_ARCHIVE=$OUT/dc.tgz bash bench/device_checks.sh /tmp/dc e2e step train
# What each took (H200): ref ~60 s; extract ~225 s with its lean defaults (2026-12-04: 280 s with every
# variant and row; fused and split add their probes); e2e ~180 s lean (its defaults here: 20 train steps,
# eval of 2 prompts x 16 tokens without the untrained baseline; 2026-11-30: extract 65 s, status and verify
# 14 s, train 36 s, then eval, in fp32 with cold Triton caches, cut at 61 s); step ~70 s; train ~140 s (the
# 27B-shaped run's start ~60 s, then its steps). ~120 s of machine start + 360 + ~400 = ~880 of the 900.
# `mask` (only when named) is for a session with time left: the `train` step's 27B run shows whether it steps.
# Why that order: extract matters most, then train. `ref` goes first all the same: extract compares its
# kernels with ref's fp32 states, and ref costs ~45 s on an H200 and nothing on an H100 (skipped there:
# the fp32 forward of the 27B-shaped stack needs ~93 GiB). `e2e` (a tiny model, functional only) comes after
# extract: beside it, it would skew extract's timings. A step with under MIN_STEP_S left is skipped, the
# reason recorded. In call 2, `train` (the 27B-shaped run) gets what `step` (the bare DFlash step at 27B
# shapes, bounded) leaves; bench/gpu_train.py saves its JSON after each part, so a cut run still says something.
# EXTRACT_VARIANTS and EXTRACT_PIPELINE_ROWS (default conv,norms,fused,split and lean) choose the extract step's
# variants and pipeline rows: eager,conv,norms,fused,split,tokens32k and all for the whole set.
# Back here: tar xzf dc.tgz, and record the JSONs (docs/bench/gpu_extract.json, gpu_train.json) and
# numbers (docs/benchmarks.md; bench/gpu_train_cli.py and bench/cli_e2e.py --report --write-docs).
#
# Time: DEVICE_CHECKS_DEADLINE_S (default 570, for a 600 s call) counts from this script's start. Each
# step's limit is its own cap clipped to the time left minus MARGIN_S (20 s, for the last archive) and
# KILL_AFTER_S (10 s: a step that ignores its SIGTERM is killed then). The archive of every log and
# JSON ($DEVICE_CHECKS_ARCHIVE; a call brings back at most 8 files, hence one archive) is rewritten
# after each step and every ARCHIVE_EVERY_S (30 s) while steps run, so a call cut by the device tool
# still brings back what the steps had saved by then.
#
# A second call on the warm machine skips what the first one did: the wheels' install (/tmp/site,
# /tmp/fla, each with a marker written once its install succeeded) and the environment probe (env.txt).
#
# What it needs beside the repo (made by bench/device_prep.sh here; carry ".whl" and ".devcache/e2e",
# or ".devcache" whole for the loader steps: the 64 MiB a call carries fit the first pair, not all):
#   .whl/       wheels the GPU image lacks (boto3, moto[server], zstandard, transformers, ...) for its
#               Python; .whl/fla/ holds flash-linear-attention, installed apart (/tmp/fla) so that
#               the reference step runs on transformers' torch fallback
#   .devcache/  tests/activations.py's cached SmolLM2 activations (the loader bench's samples), and
#               e2e/ (bench/cli_e2e.py's target and rows), since SmolLM2 is not on that machine
# Steps, in the order they run (default: ref extract e2e step train):
#   ref      bench/gpu_extract.py without fla: the torch-fallback forward's speed and the fp32
#            reference states the fast kernels are compared with (OUTDIR.ref.safetensors, beside
#            OUTDIR: ~200 MB, not archived). Skipped on a GPU under REF_MIN_GIB (110 GiB).
#   extract  bench/gpu_extract.py with fla: fla's short convolution, + fused RMSNorms, + fused projections, + split conv (EXTRACT_VARIANTS),
#            errors vs the reference (when ref left one), the top kernels, the pipeline into tmpfs and into moto
#   e2e      bench/cli_e2e.py: the real CLI (extract -> status -> verify -> train -> eval) on a small
#            random qwen3_5_text target into moto on this host (at most 240 s)
#   mask     (only when named; first in call 2: ~10-60 s, before `train` can use the call up)
#            bench/block_mask.py on the GPU: the drafter's tiled BlockMask vs a compiled and an eager
#            create_block_mask over one epoch's shapes (the compiled one is the first suspect for the
#            27B trainer's 132 s without a step, 2026-12-04)
#   step     bench/gpu_train.py: DFlash step at Qwen3.6-27B shapes (4,096 tokens x 512 anchors): the
#            loss in chunks vs unchunked (memory; issue 18 section 3), flex vs dense gradients
#   train    bench/gpu_train_cli.py: the real `layertap train` from moto at Qwen3.6-27B's shapes
#            and with a small drafter (data wait, tokens/s, peak memory); TRAIN_ARGS adds arguments
#   compile  (only when named; answered 2026-11-30: compile loses to the fla short conv, 0.42 vs
#            0.50 MFU) bench/gpu_extract.py on 16 layers: eager vs torch.compile of each layer
#   loader   (only when named) bench/loader.py at 1 GB, 5 rounds, on 16 cores: loader vs raw boto3 GETs
#            (issue 5), with 2, 4 and 8 decode threads beside the default
#   stages   (only when named) the loader's stages on bf16-zstd at 4 GB (passes of ~5 s, so the
#            first object's latency weighs less): fetch and checks alone, a 0.5 ms GIL switch
#            interval, 2 DataLoader workers: where a pass's time goes
#   malloc   (only when named) bench/page_faults.py, then bench/loader.py --stages at 1 GB under
#            the glibc settings the Slurm training jobs export (docs/LOADER.md, "Memory
#            allocator"), beside the same at defaults
#   writer   (only when named) bench/writer.py: streaming writer vs boto3 upload_file, and moto's ingest ceiling
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
# DEVICE_CHECKS_TINY=1 runs the steps' benches on tiny configs (e2e with few steps): a CPU rehearsal of
# this script, its deadline and archive loop included (no GPU: ref is not skipped for memory there;
# extract runs without a reference when ref did not leave one).
set -u
tiny=${DEVICE_CHECKS_TINY:+--tiny}
out=${1:?usage: bench/device_checks.sh OUTDIR [STEP ...]}
out=${out%/}
shift
steps=${*:-ref extract e2e step train}
deadline=${DEVICE_CHECKS_DEADLINE_S:-570}  # seconds from this script's start ($SECONDS counts from 0)
MARGIN_S=20          # kept free after each step's limit: the last archive, and the script's own exit
KILL_AFTER_S=10      # a step still running this long after its SIGTERM is killed (timeout -k)
MIN_STEP_S=30        # a step with less time than this left is skipped: it could not finish anything
# ... and these steps need more to say anything at all (e2e: its eval comes after ~140 s of other steps;
# extract: fla's warm-up and the bare forward; train: the 27B-shaped run's ~60 s start)
declare -A STEP_MIN_S=([extract]=150 [e2e]=170 [train]=100)
ARCHIVE_EVERY_S=30
REF_MIN_GIB=110      # the fp32 reference forward of the 27B-shaped stack needs ~93 GiB (an H100 has 79)
ref_file=$out.ref.safetensors  # beside OUTDIR, not in it: ~200 MB, too big to come back
mkdir -p "$out"
# no network on the GPU machine: transformers and huggingface_hub must not try the hub (and wait on it)
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

wants() { [[ " $steps " == *" $1 "* ]]; }
known=" ref extract e2e mask step train compile loader stages malloc writer recipe "
for s in $steps; do  # a misspelt step ran nothing and said nothing
    [[ "$known" == *" $s "* ]] || { echo "device_checks: unknown step '$s' (steps:$known)" >&2; exit 2; }
done

note() {  # a line in env.txt (the run's own log) and on stdout (the device tool's output tail)
    echo "$*" | tee -a "$out/env.txt"
}

archive() {
    # tar into a temp name beside the archive, then rename: the device tool may stop the call at
    # any moment and must find either the last whole archive or the new one. tar exits 1 when a
    # file changed while it read it (a bench rewriting its JSON): that archive is still good.
    [ -n "${DEVICE_CHECKS_ARCHIVE:-}" ] || return 0
    local tmp="$DEVICE_CHECKS_ARCHIVE.tmp$BASHPID" rc=0
    tar --warning=no-file-changed -czf "$tmp" -C "$(dirname "$out")" "$(basename "$out")" 2>/dev/null || rc=$?
    if [ "$rc" -le 1 ]; then
        mv -f "$tmp" "$DEVICE_CHECKS_ARCHIVE"
    else
        rm -f "$tmp"
        echo "archive: tar failed (rc $rc)" >&2
    fi
}

archiver() {  # run in the background: the archive rewritten every ARCHIVE_EVERY_S while steps run
    trap - EXIT INT
    # on TERM (the script's end): drop a half-written temp file, never leave it in $OUT. Bash runs
    # this trap between commands: after a running tar ends, before its mv.
    trap 'rm -f "$DEVICE_CHECKS_ARCHIVE.tmp$BASHPID"; exit 0' TERM
    local last=$SECONDS
    while sleep 1; do  # short sleeps: the TERM trap waits for the running command
        if ((SECONDS - last >= ARCHIVE_EVERY_S)); then
            archive
            last=$SECONDS
        fi
    done
}

finish() {
    trap - EXIT
    if [ -n "${archiver_pid:-}" ]; then
        kill -TERM "$archiver_pid" 2>/dev/null
        wait "$archiver_pid" 2>/dev/null
    fi
    cp docs/benchmarks.md "$out/benchmarks.md"  # what the loader steps' --write-docs changed
    note "device_checks: done at $SECONDS s (deadline $deadline s)"
    archive
    [ -z "${DEVICE_CHECKS_ARCHIVE:-}" ] || rm -f "$DEVICE_CHECKS_ARCHIVE".tmp*  # no stray temp file comes back
}
trap finish EXIT
trap 'note "device_checks: stopped by a signal at $SECONDS s"; exit 143' TERM INT

skip() {  # a step not run, and why: in env.txt and in its log, so the archive says so
    local name=$1
    shift
    echo "skipped: $*" >"$out/$name.log"
    note "step $name: skipped: $*"
}

step() {  # step NAME CAP_S COMMAND...: COMMAND under min(CAP_S, the time left) into OUTDIR/NAME.log
    local name=$1 cap=$2
    shift 2
    wants "$name" || return 0
    local left=$((deadline - SECONDS)) limit
    limit=$((left - MARGIN_S - KILL_AFTER_S))
    ((cap < limit)) && limit=$cap
    if ((limit < ${STEP_MIN_S[$name]:-$MIN_STEP_S})); then
        skip "$name" "$left s left before the deadline ($deadline s), too few to run it (it needs ${STEP_MIN_S[$name]:-$MIN_STEP_S} s)"
        return 0
    fi
    local t0=$SECONDS rc=0
    timeout -k "$KILL_AFTER_S" "$limit" "$@" >"$out/$name.log" 2>&1 || rc=$?
    note "step $name: rc=$rc in $((SECONDS - t0)) s (limit $limit s$( ((rc == 124 || rc == 137)) && echo ", cut there"))"
    archive
}

gpu_gib() {  # the GPU's memory in GiB, or nothing without nvidia-smi (a CPU rehearsal)
    nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1 | awk '$1 + 0 > 0 {printf "%d", $1 / 1024}'
}

install_once() {  # install_once TARGET WHEEL...: once per machine (the marker is written only after success)
    local target=$1
    shift
    [ -f "$target/.installed" ] && return 0
    rm -rf "$target"
    timeout 180 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$target" "$@" \
        && touch "$target/.installed"
}

if [ -n "${DEVICE_CHECKS_ARCHIVE:-}" ]; then
    rm -f "$DEVICE_CHECKS_ARCHIVE".tmp*  # a temp file of an earlier call killed mid-tar
    archiver </dev/null >/dev/null 2>>"$out/archiver.log" &
    archiver_pid=$!
fi

# every step but `recipe` (which carries its own wheels in .devcache/recipe-1..3) needs .whl's packages
needs_whl=
for s in $steps; do [ "$s" = recipe ] || needs_whl=1; done
if [ -z "$tiny" ] && [ -n "$needs_whl" ]; then  # wheels for the GPU host's Python (3.12)
    if [ -d .whl ]; then
        install_once /tmp/site .whl/*.whl || { note "pip install of .whl failed: stopping"; exit 1; }
    fi
    # a second call on the warm machine need not carry .whl again: the first one's install is there
    if [ -f /tmp/site/.installed ]; then
        export PYTHONPATH=/tmp/site
    else
        note "no .whl here and none installed on this machine (a fresh one): carry .whl; stopping"
        exit 1
    fi
fi
if [ -d .whl/fla ]; then
    install_once /tmp/fla .whl/fla/*.whl || note "pip install of .whl/fla failed: extract runs on the torch fallback"
fi
with_fla="env PYTHONPATH=/tmp/fla:${PYTHONPATH:-}"
export TRITON_CACHE_DIR=/tmp/triton-cache  # fla's kernels compile once for all the steps
export PYTHONUNBUFFERED=1 LAYERTAP_TEST_CACHE=$PWD/.devcache TOKENIZERS_PARALLELISM=false
if [ ! -s "$out/env.txt" ]; then  # a second call on the warm machine has it from the first (~10 s of imports)
    {
        nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
        nproc; free -g | head -2; df -h /dev/shm /tmp
        timeout 60 python3 -c "import torch, transformers, boto3, moto; print('torch', torch.__version__, 'transformers',
transformers.__version__, 'boto3', boto3.__version__, 'moto', moto.__version__)"
        timeout 60 $with_fla python3 -c "import fla; print('fla', fla.__version__)"
    } >>"$out/env.txt" 2>&1
    tail -n 4 "$out/env.txt"  # the versions (or the import error) in the device tool's output tail
    if [ -n "$needs_whl" ] && ! grep -q '^torch .* moto ' "$out/env.txt"; then
        note "torch, transformers, boto3 and moto do not all import here (env.txt): stopping"
        mv "$out/env.txt" "$out/env-failed.txt"  # a rerun probes again
        exit 1
    fi
fi
note "device_checks: steps '$steps' from $(date -u +%H:%M:%S) UTC, deadline $deadline s"

if wants ref; then
    rm -f "$ref_file" "$ref_file.part"  # never compare with an earlier run's reference
    gib=$(gpu_gib)
    if [ -n "$gib" ] && ((gib < REF_MIN_GIB)); then
        skip ref "the GPU has $gib GiB, the fp32 reference forward needs ~93 GiB (ref runs from $REF_MIN_GIB GiB)"
    else
        step ref 150 python3 bench/gpu_extract.py $tiny --variants eager --batches 2 --reference-out "$ref_file" \
            --json "$out/gpu_extract_fallback.json"
    fi
fi
ref_in=()
[ -s "$ref_file" ] && ref_in=(--reference-in "$ref_file")  # else extract records "no reference"
# eager (fla alone) and tokens32k were measured on 2026-12-04 (9,518 and 10,782 tokens/s): by default only the
# short conv and the fused norms on top of it (`norms` is both), and the lean pipeline rows (~50 s less)
# 4 batches (the default) also make the pipeline rows: fewer would weigh its fixed drain more in local.vs_bare
step extract 300 $with_fla python3 bench/gpu_extract.py $tiny --variants "${EXTRACT_VARIANTS:-conv,norms,fused,split}" --profile \
    --pipeline --pipeline-rows "${EXTRACT_PIPELINE_ROWS:-lean}" "${ref_in[@]}" --json "$out/gpu_extract.json"
# lean: what shows each command works on a hybrid target on the GPU (eval runs fp32, its Triton kernels cold)
e2e=(--steps 20 --prompts 2 --max-new-tokens 16 --no-baseline --step-timeout 150)
[ -n "$tiny" ] && e2e=(--steps 4 --prompts 1 --max-new-tokens 4 --no-baseline)  # cli_e2e.py has no tiny mode
step e2e 240 $with_fla python3 bench/cli_e2e.py .devcache/e2e --json "$out/cli_e2e.json" "${e2e[@]}"
mask=(--device cuda)
[ -n "$tiny" ] && mask=(--tiny)
step mask 90 python3 bench/block_mask.py "${mask[@]}" --json "$out/block_mask.json"
step step 150 python3 bench/gpu_train.py $tiny --json "$out/gpu_train_step.json"
# TRAIN_ARGS: more arguments for the bench (call 2 of the plan: the 27B-shaped run alone, in the time left)
step train 300 $with_fla python3 bench/gpu_train_cli.py $tiny ${TRAIN_ARGS:-} --json "$out/gpu_train.json"
step compile 150 $with_fla python3 bench/gpu_extract.py $tiny --layers 1,15 --variants eager,conv,compile --batches 3 \
    --json "$out/gpu_extract_compile.json"
step loader 240 python3 bench/loader.py --rounds 5 --mb 1024 --decode-threads 2,4,8 --label gpu-host --write-docs
step stages 300 python3 bench/loader.py --rounds 3 --mb 4096 --codecs bf16-zstd --stages --workers 2 \
    --label gpu-host-stages --write-docs
if wants malloc; then
    # what the Slurm training jobs export: one source, slurm.scripts.MALLOC_SETTINGS
    if malloc_env=$(python3 -c 'from layertap.slurm.scripts import MALLOC_SETTINGS as m; print(*(f"{k}={v}" for k, v in m.items()))'); then
        step malloc 300 bash -c 'python3 bench/page_faults.py --label gpu-host --write-docs && python3 bench/loader.py --rounds 3 --mb 1024 --stages --label gpu-host-malloc-defaults \
            --write-docs && env '"$malloc_env"' python3 bench/loader.py --rounds 3 --mb 1024 --stages --label gpu-host-malloc-tuned --write-docs'
    else
        skip malloc "could not read layertap.slurm.scripts.MALLOC_SETTINGS"
    fi
fi
step writer 120 python3 bench/writer.py --mb 256 --label gpu-host --write-docs

recipe() {  # SmolLM2 and ShareGPT from .devcache/recipe-1..3
    local recipe=(--work "$PWD/.devcache/recipe-work" --json "$out/train_dflash.json" --png "$out/train_curve_recipe.png")
    if [ -n "$tiny" ]; then  # the embedded SmolLM2 and ShareGPT of this machine, a few steps
        recipe+=(--limit 16 --steps 4 --every 2 --prompts 2 --max-new-tokens 8 ${RECIPE_ARGS:-})
    else
        mkdir -p /tmp/smollm2
        cat .devcache/recipe-1/smollm2.gguf.part1 .devcache/recipe-2/smollm2.gguf.part2 \
            .devcache/recipe-3/smollm2.gguf.part3 >/tmp/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
            || { skip recipe "the GGUF's parts are not all here (.devcache/recipe-1..3)"; return 0; }
        install_once /tmp/site-recipe .devcache/recipe-1/*.whl .devcache/recipe-2/*.whl \
            || { skip recipe "pip install of the recipe's wheels failed"; return 0; }
        export PYTHONPATH=/tmp/site-recipe:${PYTHONPATH:-}
        python3 -c "import sys, zstandard; sys.stdout.buffer.write(zstandard.decompress(open(sys.argv[1], 'rb').read(),
max_output_size=1 << 31))" .devcache/recipe-3/sharegpt.jsonl.zst >/tmp/sharegpt.jsonl \
            || { skip recipe "could not unpack .devcache/recipe-3/sharegpt.jsonl.zst"; return 0; }
        recipe+=(--model /tmp/smollm2 --gguf-file SmolLM2-135M-Instruct.Q4_1.gguf --dataset /tmp/sharegpt.jsonl
                 ${RECIPE_ARGS:---limit 10000 --max-length 1024 --epochs 3 --every 600 --codecs bf16-zstd -- --batch-size 16 --block-size 16 --max-anchors 256})
    fi
    step recipe "${RECIPE_LIMIT_S:-540}" python3 bench/train_dflash.py "${recipe[@]}"
}
wants recipe && recipe
exit 0  # finish (the EXIT trap) writes the last archive
