#!/usr/bin/env bash
# One GPU session, one Python process (bench/gpu_run.py): longpack against Hugging Face at its best on the same
# rows, kernel and precision — longpack train unified, Trainer + DataCollatorWithFlattening on the same varlen
# kernel, the same with Liger's kernels, TRL padding-free BFD, longpack random_padded — for a Qwen2.5-0.5B and a
# Qwen2.5-1.5B shape on lmsys-chat-1m lengths and a long-tailed set; then a profile of two longpack steps, bf16
# parity and calibration as the time left allows. Each arm's figures are in OUT/arms.jsonl as soon as it ends;
# an arm that would not finish before the deadline is skipped and said.
#
#   bench/gpu.sh                   # on a machine with a CUDA GPU; BUDGET_S seconds in all (default 540)
#   DRYRUN=1 bench/gpu.sh          # the same driver on the CPU, tiny shapes: checks the script end to end
#   WRITE=1 bench/gpu.sh           # also write the tables into docs/BENCHMARKS.md
#   MODELS=qwen2.5-1.5b bench/gpu.sh   # one model (both do not fit one 540 s budget: a second session runs this)
#
# Wheels the GPU image lacks (datasets, trl, liger-kernel): bench/gpu_wheels.sh puts them in bench/wheels here
# (git-ignored: name bench/wheels in the device call's carry); this script installs them with --no-deps first. The
# Liger and TRL arms are skipped and said where their package is missing.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
OUT=${OUT:-$(mktemp -d)}
"$PY" -c "import longpack" 2>/dev/null || export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"  # not installed
if [ "${DRYRUN:-0}" != "1" ]; then  # the GPU machine's image: the wheels it lacks, shipped beside the tree
    for wheel in bench/wheels/*.whl; do
        [ -e "$wheel" ] && "$PY" -m pip install --quiet --no-deps "$wheel"
    done
fi
ARGS=("$OUT" --budget "${BUDGET_S:-540}")
[ "${DRYRUN:-0}" = "1" ] && ARGS+=(--dry-run)
[ -n "${MODELS:-}" ] && ARGS+=(--models "$MODELS")
[ "${WRITE:-0}" = "1" ] && ARGS+=(--write)
echo "bench/gpu.sh: outputs in $OUT"
exec "$PY" bench/gpu_run.py "${ARGS[@]}"
