#!/usr/bin/env bash
# GPU benchmark, one script for when a GPU machine is lent (budget: under 8 minutes on one H100/H200):
# 1. bf16 parity of every path (documents, chunk chains, LongpackTrainer; FSDP2, CP 2 and PP 2 with 2+ GPUs) against
#    transformers' own unpacked training of the same rows (bench/gpu_parity.py);
# 2. the cost model calibrated on the GPU for a qwen2.5-0.5b-shaped random model in bf16, then packed (unified,
#    TRL-style bfd, isf) and padded (random_padded) plans trained for real on the one engine, with tokens/s, MFU and
#    measured peak memory (max_memory_allocated) beside the cost model's prediction per step (bench/gpu_report.py);
# 3. tokens/s of `longpack train` and LongpackTrainer against transformers.Trainer with DataCollatorWithFlattening
#    and with one row per micro-batch + gradient accumulation, every arm on the same FlashAttention varlen kernel,
#    on the same rows (bench/hf_throughput.py --gpu).
# Results go to docs/BENCHMARKS.md with WRITE=1 (the GPU named).
#
#   bench/gpu.sh                 # on a machine with a CUDA GPU (the project installed, or its src/ is used)
#   DRYRUN=1 bench/gpu.sh        # the same pipeline on CPU with tiny-llama, to check the script itself
#   BUDGET_S=400 STEPS=6 BATCH=32 HF_ROWS=128 bench/gpu.sh   # a shorter lease
#
# Attention on the GPU is torch's own FlashAttention varlen kernel (torch.nn.attention.varlen, bf16; runtime/varlen.py):
# one call per layer for every document of a micro-batch, no flash_attn package needed.
# Every stage runs under its own time limit, its stdout and stderr kept in OUT; a failing stage is reported and the
# next one runs; stages that would start past BUDGET_S seconds are skipped and listed (OUT/stages.txt).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
"$PY" -c "import longpack" 2>/dev/null || export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"  # not installed
BUDGET_S=${BUDGET_S:-900}
if [ "${DRYRUN:-0}" = "1" ]; then
    MODEL=tiny-llama; GRID=cpu; DTYPE=float32; STEPS=3; BATCH=16; CAP=2048; WORKLOAD=tiny-longtail; BASE=cpu
else
    MODEL=${MODEL:-qwen2.5-0.5b}; GRID=gpu; DTYPE=bfloat16; STEPS=${STEPS:-12}; BATCH=${BATCH:-64}
    CAP=${CAP:-16384}; WORKLOAD=${WORKLOAD:-lmsys-chat-1m}; BASE=${BASE:-h100}
    "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || {
        echo "bench/gpu.sh: no CUDA device visible to torch; run it on a GPU machine (or DRYRUN=1 to test)" >&2
        exit 2; }
fi
NGPU=${NGPU:-1}
LAUNCH=("$PY")
[ "$NGPU" -gt 1 ] && LAUNCH=("$PY" -m torch.distributed.run --standalone --nproc-per-node "$NGPU")
echo "bench/gpu.sh: model $MODEL, $DTYPE, $NGPU process(es), budget ${BUDGET_S}s, outputs in $OUT"
: > "$OUT/stages.txt"
FAILED=0

# stage NAME LIMIT_S STDOUT_FILE COMMAND...: stdout to OUT/STDOUT_FILE, stderr to OUT/NAME.err, one status line.
stage() {
    local name=$1 limit=$2 file=$3 t0=$SECONDS rc
    shift 3
    if [ $((SECONDS + 20)) -gt "$BUDGET_S" ]; then
        echo "$name: skipped (budget ${BUDGET_S}s spent)" | tee -a "$OUT/stages.txt"; FAILED=1; return
    fi
    [ "$limit" -gt $((BUDGET_S - SECONDS)) ] && limit=$((BUDGET_S - SECONDS))  # the budget bounds the last stage
    timeout "$limit" "$@" > "$OUT/$file" 2> "$OUT/$name.err"
    rc=$?
    echo "$name: exit $rc in $((SECONDS - t0))s$([ $rc = 124 ] && echo " (time limit ${limit}s)")" \
        | tee -a "$OUT/stages.txt"
    if [ $rc != 0 ]; then FAILED=1; tail -n 15 "$OUT/$name.err" | sed "s/^/  $name| /"; fi
}

stage env 60 env.txt "$PY" - <<'PYEOF'
import platform, torch, transformers
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "transformers", transformers.__version__)
if torch.cuda.is_available():
    print("gpu", torch.cuda.get_device_name(), torch.cuda.get_device_capability(),
          round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1), "GiB")
try:
    import torch.nn.attention.varlen  # noqa: F401
    print(torch.ops.torch_attn._varlen_attn.default._schema)
    print(torch.ops.torch_attn._varlen_attn_backward.default._schema)
except Exception as e:  # noqa: BLE001
    print("no varlen ops:", repr(e))
PYEOF
cat "$OUT/env.txt"
if [ "${DRYRUN:-0}" = "1" ]; then
    stage parity 900 parity.txt "$PY" bench/gpu_parity.py "$OUT/parity" --dry-run --ngpu "$NGPU"
else
    stage parity 300 parity.txt "$PY" bench/gpu_parity.py "$OUT/parity" --ngpu "$NGPU" ${WRITE:+--write}
fi
cat "$OUT/parity.txt"
train() {
    stage "train-$1" 300 "train-$1.jsonl" "${LAUNCH[@]}" -m longpack.cli train --workload "$WORKLOAD" --samples 20000 \
        --model "$MODEL" --planner "$1" --dtype "$DTYPE" --steps "$STEPS" --global-batch "$BATCH" --token-cap "$CAP" --json
}
train unified
train random_padded
stage calibrate 240 calibrate.json "$PY" -m longpack.cli calibrate --model "$MODEL" --base "$BASE" --dtype "$DTYPE" \
    --grid "$GRID" --repeats 3 --out "$OUT/calibrated.json" --json
train bfd
train isf
if [ "$NGPU" -gt 1 ]; then  # LongpackTrainer under Accelerate's FSDP2 (not applied on CPU) against plain float64
    stage hf-fsdp 300 hf-fsdp.log env HF_CASE_GPU=1 "$PY" -m torch.distributed.run --standalone --nproc-per-node \
        "$NGPU" tests/hf_run.py "$OUT/hf-fsdp.pt" 1 fsdp
    stage hf-fsdp-compare 60 hf-fsdp.txt "$PY" tests/hf_run.py --compare "$OUT/hf-fsdp.pt"
fi
stage report 120 report.txt "$PY" bench/gpu_report.py "$OUT" --model "$MODEL" --workload "$WORKLOAD" \
    --steps "$STEPS" --batch "$BATCH" --cap "$CAP" ${WRITE:+--write}
cat "$OUT/report.txt"
if [ "${DRYRUN:-0}" != "1" ]; then
    stage hf-throughput 600 hf-throughput.txt "$PY" bench/hf_throughput.py --gpu "$NGPU" --rows "${HF_ROWS:-512}" \
        --global-batch "$BATCH" --repeat 1 --cap "$CAP" ${WRITE:+--write}
    cat "$OUT/hf-throughput.txt"
fi
echo "--- stages"; cat "$OUT/stages.txt"
[ "$FAILED" = "0" ] || { echo "bench/gpu.sh: a stage failed or was skipped, or a path left parity (above)" >&2; exit 1; }
