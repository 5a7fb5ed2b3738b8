# One entry point. `make run` and `make test` create the environment when it is missing.
# On a CPU machine torch comes from the CPU wheel (pinned below); on a GPU cluster use
# `make TORCH_SPEC=torch` (or environment.yml) to get a CUDA build.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= test,course
TORCHAO_SPEC ?= torchao==0.18.0
TORCHFT_SPEC ?= torchft==0.2.0
# torchtitan's Llama 3 (tests/test_titan.py, minitron/titan.py) and what its import needs, no more
TITAN_SPECS ?= torchtitan==0.3.0 spmd_types==0.2.3 tyro==1.0.17 docstring_parser==0.18.0 shtab==1.13.0 \
	typeguard==4.6.1 triton==3.9.0
TORCHFT_DEPS := "opentelemetry-api>=1.39.0" "opentelemetry-sdk>=1.39.0" "opentelemetry-exporter-otlp-proto-http>=1.39.0"
ORACLE := $(VENV)/oracle
comma := ,
STAMP := $(VENV)/.installed-$(subst $(comma),-,$(EXTRAS))
FT_STAMP := $(VENV)/.installed-$(subst ==,-,$(TORCHFT_SPEC))
TITAN := $(VENV)/titan
TITAN_STAMP := $(VENV)/.installed-$(subst ==,-,$(firstword $(TITAN_SPECS)))
NPROC ?= 8

.PHONY: env browser run run-single test test-fast clean

env: $(STAMP) $(FT_STAMP) $(TITAN_STAMP)

# Said before pip runs (it is quiet): what is installed, where, and roughly how long it takes.
$(STAMP): pyproject.toml
	@echo "make: installing into $(VENV) (once): $(TORCH_SPEC) (the CPU wheel, about 200 MB), then minitron"
	@echo "      with its extras [$(EXTRAS)] (transformers, tensorboard, jupyterlab, nbval, matplotlib, ...):"
	@echo "      about 2-4 minutes on a fast connection, quiet until it is done"
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[$(EXTRAS)]"
	@# torchao, the FP8 tests' external oracle, beside the environment rather than in it: where it is
	@# importable, transformers imports it with every model class, and on a CPU machine it then logs
	@# that its CUDA kernels do not load (noise in every notebook and command that reads a HF model)
	$(BIN)/python -m pip install -q --no-deps --target $(ORACLE) "$(TORCHAO_SPEC)"
	@echo "make: $(VENV) is ready"
	touch $@

# torchft (--ft-replicas: fault-tolerant replicas, minitron/fault_tolerance.py) in the environment, where
# the ranks import it; a stamp of its own, so that an environment made before it gets it too. --no-deps:
# its `torch>=2.7` can never swap the torch above; its real dependencies (OpenTelemetry) are listed here.
# A wheel for CPython 3.11 on x86-64 Linux only: elsewhere nothing is built (its tests skip).
$(FT_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q --no-deps --only-binary :all: "$(TORCHFT_SPEC)" && \
	    $(BIN)/python -m pip install -q $(TORCHFT_DEPS) || echo "make: torchft has no wheel here; --ft-replicas unavailable"
	touch $@

# torchtitan beside the environment, as torchao is (--no-deps: its requirements would replace torch
# 2.13 and bring datasets, wandb, ...; its model package imports only these). Its import puts triton
# (about 1 GB unpacked) and spmd_types on the path, so only its test's own subprocess reads $(TITAN).
$(TITAN_STAMP): $(STAMP)
	@echo "make: torchtitan's Llama 3 into $(TITAN) (once; triton is about 1 GB): $(TITAN_SPECS)"
	$(BIN)/python -m pip install -q --no-deps --target $(TITAN) $(TITAN_SPECS) || \
	    echo "make: torchtitan did not install; tests/test_titan.py skips its two-way checks"
	touch $@

# The main job: train the GPT on Shakespeare on 8 local CPU ranks composing all three
# parallelisms (PTD-P): data 2 x tensor 2 (+ sequence parallel) x pipeline 2 (interleaved,
# 2 chunks per rank), ZeRO-1; progress bar, loss, sample text, metrics, the run report and a
# loss figure (runs/metrics.loss.png). The model of nanoGPT's CPU recipe (4 layers, 4 heads,
# width 128, context 64); global batch 64 for 500 steps (2.0 M bytes), lr 3e-3: validation
# loss 1.87 nats per byte (benchmarks/RESULTS.md, "The first run": nanoGPT's recipe beside it).
# The last step's checkpoint goes to $(CKPT) (replaced by the next `make run`), which
# `minitron sample --ckpt-dir $(CKPT)` reads. `make run STEPS=20` is a quick look.
CKPT ?= runs/ckpt
STEPS ?= 500
run: $(STAMP)
	$(BIN)/minitron train --model small --seq-len 64 --nproc 8 --dp 2 --tp 2 --sp --pp 2 --vpp 2 \
	    --schedule interleaved --zero1 --microbatches 4 --global-batch 64 --steps $(STEPS) --lr 3e-3 \
	    --eval-every 100 --metrics runs/metrics.jsonl --ckpt-dir $(CKPT) --overwrite
	@echo "next: $(BIN)/minitron sample --ckpt-dir $(CKPT) --prompt 'ROMEO:'   (more text from the trained model)"

# The same GPT on one CPU process.
run-single: $(STAMP)
	$(BIN)/minitron train --model small --steps 300 --global-batch 16 --eval-every 50 \
	    --metrics runs/metrics-single.jsonl

# Debian's Chromium for the browser tests (tests/test_browser.py), installed once when it
# is missing and we are root (CI); otherwise the script says how, and those tests skip.
BROWSER_STAMP := $(VENV)/.browser-installed
browser: $(BROWSER_STAMP)

$(BROWSER_STAMP): scripts/install_browser.sh
	@mkdir -p $(VENV)
	@if bash scripts/install_browser.sh; then touch $@; \
	else echo "make: going on without Chromium (see above): tests/test_browser.py installs it when root, else skips"; fi

# The whole test suite (what CI runs): two pytest sessions side by side, one per core: the tests
# that start ranks, a Slurm cluster or a browser one after another, the single-process tests and
# the notebooks beside them (scripts/run_tests.sh; the split: tests/conftest.py, test_share).
test: $(STAMP) $(FT_STAMP) $(TITAN_STAMP) $(BROWSER_STAMP)
	bash scripts/run_tests.sh $(BIN)/python

test-fast: $(STAMP) $(FT_STAMP) $(TITAN_STAMP)
	$(BIN)/python -m pytest -q -m "not multirank and not browser and not slurm"

clean:
	rm -rf runs .pytest_cache
