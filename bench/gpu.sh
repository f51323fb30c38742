#!/usr/bin/env bash
# GPU benchmark, one script for when a GPU machine is lent (budget: under 8 minutes on one H100/H200):
# 1. bf16 parity of every path (documents, chunk chains, LongpackTrainer; FSDP2, CP 2 and PP 2 with 2+ GPUs) against
#    transformers' own unpacked training of the same rows (bench/gpu_parity.py);
# 2. the cost model calibrated on the GPU for a qwen2.5-0.5b-shaped random model in bf16, then packed (unified,
#    TRL-style bfd, isf) and padded (random_padded) plans trained for real on the one engine, with tokens/s, MFU and
#    measured peak memory (max_memory_allocated) beside the cost model's prediction per step (bench/gpu_report.py);
# 3. tokens/s and MFU of `longpack train` and LongpackTrainer against transformers.Trainer with
#    DataCollatorWithFlattening and with one row per micro-batch + gradient accumulation, on flash_attention_2 where
#    flash_attn is installed, else sdpa, on the same rows (bench/hf_throughput.py --gpu).
# Results go to docs/BENCHMARKS.md with WRITE=1 (the GPU named).
#
#   bench/gpu.sh                 # on a machine with a CUDA GPU and this project installed (make install)
#   DRYRUN=1 bench/gpu.sh        # the same pipeline on CPU with tiny-llama, to check the script itself
#
# Attention on the GPU is torch's own FlashAttention varlen kernel (torch.nn.attention.varlen, bf16; runtime/varlen.py):
# one call per layer for every document of a micro-batch, no flash_attn package needed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
OUT=${OUT:-$(mktemp -d)}
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
LAUNCH="$PY"
[ "$NGPU" -gt 1 ] && LAUNCH="$PY -m torch.distributed.run --nproc-per-node $NGPU"
echo "bench/gpu.sh: model $MODEL, $DTYPE, $NGPU process(es), outputs in $OUT"
PARITY_STATUS=0
if [ "${DRYRUN:-0}" = "1" ]; then
    "$PY" bench/gpu_parity.py "$OUT/parity" --dry-run --ngpu "$NGPU" || PARITY_STATUS=$?
else
    "$PY" bench/gpu_parity.py "$OUT/parity" --ngpu "$NGPU" ${WRITE:+--write} || PARITY_STATUS=$?
fi
"$PY" -m longpack.cli calibrate --model "$MODEL" --base "$BASE" --dtype "$DTYPE" --grid "$GRID" --repeats 3 \
    --out "$OUT/calibrated.json" --json > "$OUT/calibrate.json"
for planner in random_padded bfd isf unified; do
    $LAUNCH -m longpack.cli train --workload "$WORKLOAD" --samples 20000 --model "$MODEL" --planner "$planner" \
        --dtype "$DTYPE" --steps "$STEPS" --global-batch "$BATCH" --token-cap "$CAP" --json \
        > "$OUT/train-$planner.jsonl"
done
if [ "$NGPU" -gt 1 ]; then  # LongpackTrainer under Accelerate's FSDP2 (not applied on CPU) against plain float64
    HF_CASE_GPU=1 "$PY" -m torch.distributed.run --standalone --nproc-per-node "$NGPU" tests/hf_run.py \
        "$OUT/hf-fsdp.pt" 1 fsdp > "$OUT/hf-fsdp.log" 2>&1
    "$PY" tests/hf_run.py --compare "$OUT/hf-fsdp.pt" | tee "$OUT/hf-fsdp.txt"
fi
"$PY" bench/gpu_report.py "$OUT" --model "$MODEL" --workload "$WORKLOAD" --steps "$STEPS" --batch "$BATCH" \
    --cap "$CAP" ${WRITE:+--write}
if [ "${DRYRUN:-0}" != "1" ]; then
    "$PY" bench/hf_throughput.py --gpu "$NGPU" --rows "${HF_ROWS:-512}" --global-batch "$BATCH" --repeat 1 \
        --cap "$CAP" ${WRITE:+--write}
fi
[ "$PARITY_STATUS" = "0" ] || { echo "bench/gpu.sh: a path left bf16 parity (table above)" >&2; exit 1; }
