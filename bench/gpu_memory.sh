#!/usr/bin/env bash
# One GPU, memory and start-up: a single bf16 process (FSDP2 on a group of one: fp32 weights and AdamW state, bf16
# compute) trained for real at the lengths longpack exists for, each step's measured peak (max_memory_allocated)
# beside the cost model's prediction; the same command's CPU dry run (runtime/run/dry_run.py) is its other side.
#
#   OUT=/tmp/gm bench/gpu_memory.sh        # on a machine with a CUDA GPU; outputs in OUT
#
# 1. qwen2.5-0.5b (random init), lmsys-chat-1m lengths, 3 steps: the start-up to step 0, timed (py-spy's profile of
#    it too when .tools/py-spy or py-spy on the PATH is there);
# 2. a 4-layer Qwen2.5-7B shape (hidden 3584, GQA 28/4, vocab 152064, random init, written by save_pretrained)
#    on chatqa2-long-sft lengths (to ~70K tokens), --hardware h100 --token-cap 0 (the cap its 80 GiB allow): per
#    step, measured peak and predicted bytes. bench/gpu_memory_report.py turns both into docs/BENCHMARKS.md's
#    section, beside the dry run's figures for the same command.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
"$PY" -c "import longpack" 2>/dev/null || export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
SPY=$(command -v py-spy || { [ -x .tools/py-spy ] && echo .tools/py-spy; } || true)
"$PY" -c "import torch, transformers, platform; print('python', platform.python_version(), 'torch', torch.__version__,
 'transformers', transformers.__version__, 'gpu', torch.cuda.get_device_name())" | tee "$OUT/env.txt"

t0=$SECONDS
SMALL=(-m longpack.cli train --model qwen2.5-0.5b --workload lmsys-chat-1m --samples 2000 --dtype bfloat16 --steps 3
       --global-batch 32 --token-cap 16384 --hardware h100 --json)
if [ -n "$SPY" ]; then
    timeout 150 "$SPY" record -r 100 -f raw -o "$OUT/startup.raw" -- "$PY" "${SMALL[@]}" > "$OUT/small.jsonl" \
        2> "$OUT/small.err"
else
    timeout 150 "$PY" "${SMALL[@]}" > "$OUT/small.jsonl" 2> "$OUT/small.err"
fi
echo "small: exit $? in $((SECONDS - t0)) s" | tee -a "$OUT/stages.txt"
tail -n 5 "$OUT/small.err"

t0=$SECONDS
timeout 90 "$PY" - "$OUT/seven4" <<'PYEOF'
import sys, torch, transformers
cfg = transformers.Qwen2Config(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=4,
                               num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=131072,
                               rope_theta=1e6, tie_word_embeddings=False)
torch.manual_seed(0)
with torch.device("cuda"):
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
model.save_pretrained(sys.argv[1])
PYEOF
echo "seven4 checkpoint: exit $? in $((SECONDS - t0)) s" | tee -a "$OUT/stages.txt"
t0=$SECONDS
timeout 240 "$PY" -m longpack.cli train --model-path "$OUT/seven4" --workload chatqa2-long-sft --samples 400 \
    --dtype bfloat16 --hardware h100 --token-cap 0 --steps 3 --global-batch 8 --json > "$OUT/long.jsonl" \
    2> "$OUT/long.err"
echo "long: exit $? in $((SECONDS - t0)) s" | tee -a "$OUT/stages.txt"
tail -n 5 "$OUT/long.err"
rm -rf "$OUT/seven4"
grep -h '"memory"' "$OUT/small.jsonl" "$OUT/long.jsonl" | cut -c1-600
