# kvfence: every target sets up what it needs from a fresh clone.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# torch is installed first and pinned so that nothing pulls a multi-GB CUDA build onto a
# CPU machine. Where PyPI's torch is a CUDA build, point TORCH_INDEX at a CPU wheel index.
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
STAMP := $(VENV)/.stamp-install
# The container images `make image` and `make image-cuda` build (Dockerfile); the manifests
# in deploy/ and the Helm chart's values name the CUDA one.
IMAGE ?= kvfence:0.1.0
IMAGE_CUDA ?= $(IMAGE)-cuda
HOST ?= 127.0.0.1
PORT ?= 50051
HTTP_PORT ?= 8000
DEV_TENANTS ?= dev/tenants.toml
# Extra `kvfence serve` flags for `make serve`, e.g. make serve ARGS="--metrics-port 9464"
ARGS ?=

.PHONY: install protos lint typecheck test test-slow test-fast sanitize serve parity verify verify-avx2 mutants bench peers docs model clean gpu-wheels \
	gpu-check cluster cluster-down cluster-verify cluster-deps image image-cuda

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PIP) install -q -e ".[server,dev]"
	@touch $(STAMP)

install: $(STAMP)

model: $(STAMP)
	$(VENV)/bin/kvfence models pull

protos: $(STAMP)
	PYTHON=$(PY) protos/generate.sh

lint: $(STAMP)
	$(VENV)/bin/ruff check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy kvcache clients service protos

# Lint, types and every test not marked slow (about 5 minutes on 2 cores). CI runs this,
# then test-slow: the tests that load transformers oracles, soak, or build many kernels.
test: $(STAMP) model lint typecheck
	@$(MAKE) --no-print-directory cluster-deps || echo "kvfence: tests/cluster skip what needs them"
	$(VENV)/bin/pytest -q -p no:cacheprovider -m "not slow" --durations=10

# The slow tier: every test marked slow (CI runs it after make test).
test-slow: $(STAMP) model
	@$(MAKE) --no-print-directory cluster-deps || echo "kvfence: tests/cluster skip what needs them"
	$(VENV)/bin/pytest -q -p no:cacheprovider -m slow --durations=10

# The fast tier alone (no lint or types), for the edit-test loop.
test-fast: $(STAMP) model
	$(VENV)/bin/pytest -q -p no:cacheprovider -m "not slow"

# The C kernels' tests against three more builds of the kernels: AddressSanitizer +
# UndefinedBehaviorSanitizer (any finding aborts the run), AVX2 without AVX-512 or VNNI, and
# plain C (the last two also serve adapters through a real server). The flags and the ISA are part of each build's cache key. (The two tests left out
# check how --weights auto picks dense bf16 batches, not the kernels. Under the sanitizers the
# stack's and the layer loop's logprobs were measured to differ in low bits, with no sanitizer
# finding: that bit-for-bit test runs on the other builds only.)
KERNEL_TESTS := tests/kvcache/test_cpu_decode.py tests/kvcache/test_cpu_decode_boundary.py \
	tests/model/test_native_gemv_numerics.py tests/model/test_native_gemv.py \
	tests/model/test_native_gemv_panels.py tests/model/test_lora_stack.py \
	tests/model/test_family_stack.py \
	-k "not auto_on_a_bf16_cpu"
# Through a real server on each tier's build: PEFT adapters (q_proj/v_proj and all seven
# projections) in the native stack beside base rows, against transformers + peft.
SERVED_TIER_TESTS := tests/service/test_lora_tiers.py
SANITIZE_FLAGS := -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer -g
sanitize: $(STAMP) model
	@echo "kvfence: kernel tests, ASan + UBSan build"
	KVFENCE_KERNEL_CFLAGS="$(SANITIZE_FLAGS)" LD_PRELOAD=$$($${CC:-cc} -print-file-name=libasan.so) \
		ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=print_stacktrace=1 \
		$(VENV)/bin/pytest -q -p no:cacheprovider $(KERNEL_TESTS) \
		--deselect tests/model/test_native_gemv.py::test_decoder_stack_decodes_bit_for_bit_as_the_layer_loop
	@for isa in avx2 portable; do echo "kvfence: kernel tests and adapters served, $$isa build" && \
		KVFENCE_KERNEL_ISA=$$isa $(VENV)/bin/pytest -q -p no:cacheprovider $(KERNEL_TESTS) \
		$(SERVED_TIER_TESTS) || exit 1; \
	done

serve: $(STAMP) model
	$(PY) -m service.serve.dev --tenants $(DEV_TENANTS) --host $(HOST) --port $(PORT) --http-port $(HTTP_PORT) $(ARGS)

parity: $(STAMP) model
	$(PY) -m tools.parity

verify: $(STAMP) model
	$(PY) -m tests.verify_report

# The same on the AVX2 kernel build, with torch held to AVX2 too: as an AVX2-only CPU runs it.
verify-avx2: $(STAMP) model
	KVFENCE_KERNEL_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 \
		MKL_ENABLE_INSTRUCTIONS=AVX2 $(PY) -m tests.verify_report --results docs/verify-avx2

# Switch off each stated guarantee in a scratch copy and check that its tests fail; the C
# kernels' mutants again on each other kernel build this CPU runs (avx2, portable).
mutants: $(STAMP) model
	$(PY) -m tools.mutants --markdown docs/mutants.md

# The llama.cpp peers (llama-server, llama-batched-bench) from the sources the pinned
# llama-cpp-python sdist vendors, into ~/.cache/kvfence/llama.cpp/<version>/; a no-op once built.
PEER_JOBS ?= 2
peers: $(STAMP)
	nice -n 10 $(PY) -m tools.llamacpp_build --jobs $(PEER_JOBS)

bench: $(STAMP) model peers
	CMAKE_ARGS="$${CMAKE_ARGS:-$$($(PY) -m bench.llamacpp_flags)}" $(PIP) install -q -e ".[bench]"
	$(PY) -m bench.run_all
	$(PY) -m tools.benchmarks_doc

# The generated pages under docs/ (tests/test_docs.py fails while configuration.md or
# interfaces.md is stale).
docs: $(STAMP)
	$(PY) -m tools.configuration_doc
	$(PY) -m tools.interfaces_doc
	$(PY) -m tools.benchmarks_doc

# Scale-out: 3 replicas + HAProxy (deploy/haproxy/haproxy.cfg) + Redis on 127.0.0.1.
CLUSTER_TOOLS := haproxy redis-server

cluster-deps:
	@missing=""; for t in $(CLUSTER_TOOLS); do \
	  command -v $$t >/dev/null 2>&1 || [ -x /usr/sbin/$$t ] || missing="$$missing $$t"; done; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "kvfence: installing$$missing (apt-get)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq$$missing >/dev/null; \
	else echo "kvfence: needs$$missing: install with 'sudo apt-get install$$missing'"; exit 1; fi

cluster: $(STAMP) model cluster-deps
	$(PY) -m tools.cluster up

cluster-down: $(STAMP)
	$(PY) -m tools.cluster down

cluster-verify: $(STAMP) model cluster-deps
	$(PY) -m tools.cluster_verify

# The GPU check (tools/gpu_check.py). It runs where the GPU is, under that machine's own
# python3 and torch (no venv, no network): packages missing there travel as wheels in .whl/
# (git-ignored), fetched here by `make gpu-wheels` and installed there into GPU_SITE.
# On a GPU dev box with the venv: make gpu-check GPU_PYTHON=.venv/bin/python
GPU_PYTHON ?= python3
GPU_SITE ?= /tmp/kvfence-gpu-site
WHEEL_DIR ?= .whl
WHEEL_PLATFORMS := $(foreach n,manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1,--platform $(n)_x86_64)

gpu-wheels:
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp $(WHEEL_PLATFORMS) -d $(WHEEL_DIR) -r tools/gpu/wheels.txt
	@du -sh $(WHEEL_DIR)

gpu-check:
	@if ls $(WHEEL_DIR)/*.whl >/dev/null 2>&1; then \
		$(GPU_PYTHON) -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
			--upgrade --target $(GPU_SITE) $(WHEEL_DIR)/*.whl; fi
	PYTHONPATH=$(GPU_SITE)$${PYTHONPATH:+:$$PYTHONPATH} PYTHONUNBUFFERED=1 \
		$(GPU_PYTHON) tools/gpu_check.py

# The server image (Dockerfile): CPU torch and the server + tracing extras; the CUDA variant
# takes PyPI's (CUDA) torch and adds the gpu extra.
image:
	docker build --build-arg TORCH_SPEC="$(TORCH_SPEC)" -t $(IMAGE) .

image-cuda:
	docker build --build-arg TORCH_SPEC="$(TORCH_SPEC)" --build-arg TORCH_INDEX= \
		--build-arg EXTRAS=server,tracing,gpu -t $(IMAGE_CUDA) .

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis .cluster
