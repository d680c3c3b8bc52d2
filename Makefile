# `make train`: create .venv on first use, preprocess the shipped Criteo sample once, train configs/main.json.
# `make test`: the same venv, then the test suite (CPU; Triton kernels run in the interpreter).
# `make evaluate`: the newest run's best checkpoint on the sample's test split, the one a run reports
#   (CHECKPOINT=..., DATA=..., SPLIT=val for others).
# `make tensorboard`: TensorBoard (with the PyTorch profiler plugin) on runs/, at http://localhost:$(PORT).
# `make test-browser`: headless Chromium checks what TensorBoard shows for a tiny run (needs apt's chromium and
#   Playwright, which it installs; not part of `make test`); screenshots go to scripts/results/screenshots/.
# `make bench`: the GPU benchmarks (MLP kernels, sparse-side kernels, training step); rows go to scripts/results/.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
BROWSER_STAMP := $(VENV)/.browser-installed
CHROMIUM := /usr/bin/chromium
# The test split's shard, which only a train / val / test preprocess writes: a data/criteo_sample/ of an older
# preprocess (train / eval, refused by dlrm.train) is written again.
SAMPLE := data/criteo_sample/test/part-00000.parquet
DATA ?= data/criteo_sample
SPLIT ?= test
# The newest best checkpoint of either kind: best.pt of a one-process run, best/ (a sharded directory) of a
# torchrun run.
CHECKPOINT ?= $(shell ls -td runs/*/checkpoints/best.pt runs/*/checkpoints/best 2>/dev/null | head -n 1)
PORT ?= 6006

.PHONY: train evaluate tensorboard test test-gpu test-browser bench lint clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

$(SAMPLE): data/day_0_head10k.tsv.gz | $(STAMP)
	$(PY) -m dlrm.data.preprocess --input data/day_0_head10k.tsv.gz --output-dir data/criteo_sample \
		--val-fraction 0.1 --test-fraction 0.1 --overwrite

train: $(STAMP) $(SAMPLE)
	$(PY) -m dlrm.train --config configs/main.json

evaluate: $(STAMP) $(SAMPLE)
	@test -n "$(CHECKPOINT)" || { echo "no runs/*/checkpoints/best.pt or best/: run make train first" >&2; exit 2; }
	$(PY) -m dlrm.evaluate --checkpoint $(CHECKPOINT) --data $(DATA) --split $(SPLIT)

tensorboard: $(STAMP)
	$(VENV)/bin/tensorboard --logdir runs --port $(PORT)

# One pytest worker a core, up to 4 (pytest-xdist): the suite is ~85 CPU-minutes, mostly the Triton
# interpreter; the multi-rank tests start 2-3 processes each, so more workers would only oversubscribe.
test: $(STAMP)
	$(PY) -m pytest -n auto --maxprocesses 4

# Several pytest workers share the GPU: the tests are small and mostly wait on compilation (Triton JIT, nvcc).
GPU_WORKERS ?= 6
# Without a GPU every gpu test would skip and the target pass: refuse instead.
test-gpu: $(STAMP)
	@$(PY) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'make test-gpu: no CUDA GPU here (torch.cuda.is_available() is False); the gpu tests would all skip')"
	$(PY) -m pytest -m gpu -n $(GPU_WORKERS)

$(BROWSER_STAMP): $(STAMP)
	test -x $(CHROMIUM) || apt-get install -y chromium || sudo apt-get install -y chromium
	$(PY) -m pip install -q -e '.[dev,browser]'
	touch $(BROWSER_STAMP)

test-browser: $(BROWSER_STAMP) $(SAMPLE)
	$(PY) scripts/check_tensorboard.py --chromium $(CHROMIUM) --screenshots scripts/results/screenshots

bench: $(STAMP)
	$(PY) scripts/bench_kernels.py --batches 16384
	$(PY) scripts/bench_sparse.py --batch 16384
	$(PY) scripts/bench_train.py --batches 128,2048,16384,65536 --precisions tf32,bf16 \
		--backends eager,compile,triton+graphs

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) data/criteo_sample runs
