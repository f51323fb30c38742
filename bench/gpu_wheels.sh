#!/usr/bin/env bash
# The wheels bench/gpu.sh needs that the lent GPU machines' image lacks (its Python 3.12 has torch, transformers,
# triton, accelerate, pyarrow, fsspec and xxhash, and nothing can be fetched there): datasets and its dill and
# multiprocess for the Hugging Face arms, TRL for the SFTTrainer arm, liger-kernel for the Liger arm and longpack's
# Liger loss — the versions this project is tested with. Run here, where PyPI answers, before a GPU session:
#
#   bench/gpu_wheels.sh            # into bench/wheels (git-ignored: name it in the device call's carry)
#
# gpu.sh installs every wheel there with `pip install --no-deps` before it starts.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PY:-$( [ -x ../.venv/bin/python ] && echo ../.venv/bin/python || echo python3 )}
mkdir -p wheels
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d wheels \
    datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 trl==1.16.0 liger-kernel==0.8.5
ls -l wheels
