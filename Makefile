# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv when missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench install clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch first and pinned: a CPU build is on disk here, while an open range would pull a multi-GB CUDA build
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/longpack compare --workload lmsys-chat-1m --model qwen2.5-0.5b --hardware h100 \
	  --dp 4 --cp 8 --global-batch 256 --steps 8 \
	  --planners unified,skrull,chunkflow,hbp,fixed_cp,sorted,isf,random_padded,one_seq --baseline fixed_cp
	@echo "--- a short real training run: tiny Llama, 2 CPU processes (gloo), unified plan ---"
	$(BIN)/longpack train --workload tiny-longtail --planner unified --nproc 2 --steps 5
	@echo "--- next: your own rows and checkpoint (README, 'Train for real') ---"
	@echo "  source .venv/bin/activate"
	@echo "  longpack train --data rows.jsonl --model-path ./my-model --output-dir ./my-model-sft --nproc 2 --steps 4"

# Two pytest-xdist workers, each test file on one (its module fixtures built once), the longest files first
# (tests/conftest.py): about 7 minutes on 2 cores.
# One file or one test: .venv/bin/python -m pytest tests/test_plan.py (no workers needed).
test: $(STAMP)
	$(BIN)/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder

# Regenerates docs/BENCHMARKS.md. QUICK=1 shrinks every benchmark (about 25 min on 2 cores); the full run takes hours.
# The report render needs Debian's chromium (apt-get install chromium); it is skipped when absent.
# GPU figures come from bench/gpu.sh, run on a GPU machine (WRITE=1 bench/gpu.sh puts them in docs/BENCHMARKS.md).
bench: $(STAMP)
ifdef QUICK
	cd bench && ../$(BIN)/python planning.py --samples 100000 --batches 50 --write
	cd bench && ../$(BIN)/python hbp_packing.py --samples 200000 --write
	cd bench && ../$(BIN)/python quality_matrix.py --steps 2 --samples 5000 --write
	cd bench && ../$(BIN)/python exact_gap.py --steps 2 --write
	cd bench && ../$(BIN)/python train_throughput.py --samples 192 --repeat 1 --write
	cd bench && ../$(BIN)/python cp_overlap.py --steps 2 --write
	cd bench && ../$(BIN)/python sim_validation.py --steps 4 --write
	cd bench && ../$(BIN)/python train_memory.py --tokens 1024 --write
else
	cd bench && ../$(BIN)/python planning.py --write
	cd bench && ../$(BIN)/python hbp_packing.py --write
	cd bench && ../$(BIN)/python quality_matrix.py --write
	cd bench && ../$(BIN)/python exact_gap.py --write
	cd bench && ../$(BIN)/python train_throughput.py --write
	cd bench && ../$(BIN)/python chunk_memory.py --write
	cd bench && ../$(BIN)/python cp_overlap.py --write
	cd bench && ../$(BIN)/python sim_validation.py --write
	cd bench && ../$(BIN)/python train_memory.py --write
	cd bench && ../$(BIN)/python hf_throughput.py --write
endif
	-command -v chromium >/dev/null && cd bench && ../$(BIN)/python report_render.py --write

lint: $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[lint]'
	$(BIN)/ruff check src tests
	$(BIN)/mypy src/longpack --ignore-missing-imports

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
