#!/usr/bin/env bash
# Build only ArcticInference's suffix-decoding extension (CPU, no vLLM/torch/CUDA) into a cache dir.
# Usage: scripts/build_arctic_suffix.sh [CACHE_DIR]   (default .cache/arctic)
# Result: CACHE_DIR/arctic_inference/suffix_decoding/{cache.py,_C*.so}; benchmarks/replay.py
# imports `arctic_inference.suffix_decoding` from CACHE_DIR when present.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
CACHE="$(realpath -m "${1:-$ROOT/.cache/arctic}")"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
VERSION=0.3.0
mkdir -p "$CACHE/src"
cd "$CACHE/src"
if [ ! -f "arctic_inference-$VERSION.tar.gz" ] && [ ! -f "arctic-inference-$VERSION.tar.gz" ]; then
  "$PY" -m pip download --no-deps --no-binary :all: --no-build-isolation "arctic-inference==$VERSION" -d .
fi
SDIST="$(ls arctic[-_]inference-$VERSION.tar.gz | head -1)"
rm -rf "unpacked" && mkdir unpacked && tar -xzf "$SDIST" -C unpacked
SRC="$(ls -d unpacked/*/ | head -1)"
NB_DIR="$("$PY" -c 'import nanobind; print(nanobind.cmake_dir())')"
BUILD="$CACHE/build"
rm -rf "$BUILD"
cmake -S "$SRC/csrc/suffix_decoding" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release \
  -Dnanobind_DIR="$NB_DIR" -DPython_EXECUTABLE="$PY" -DPython3_EXECUTABLE="$PY" >/dev/null
cmake --build "$BUILD" -j"$(nproc)" >/dev/null
PKG="$CACHE/arctic_inference/suffix_decoding"
mkdir -p "$PKG"
touch "$CACHE/arctic_inference/__init__.py"
cp "$SRC/arctic_inference/suffix_decoding/"*.py "$PKG/"
find "$BUILD" -name '_C*.so' -exec cp {} "$PKG/" \;
ls "$PKG"
echo "built arctic suffix decoding into $CACHE"
