#!/bin/sh
# The device check on a lent GPU machine (docs/backends.md "The device check"),
# from the repository's root, after `make device-bundle` here filled .device/:
#   tools/device_check.sh build        # the CUDA wheel from .device's trimmed source: one call, at most 10 minutes
#   tools/device_check.sh run OUT      # the measurements into OUT: one call, at most 4 minutes, right after
# build keeps what it makes under DEVICE_WORK (default /tmp/specpipe-device),
# outside the carried .device/: a warm machine keeps it between calls, and a
# build cut short by a call's time limit goes on where it stopped (CMake's
# build folder is kept there too). CUDA_ARCHITECTURES (default 90: the H100 and H200)
# names the GPUs to build for; flash-attention's CUDA kernels are left out
# (GGML_CUDA_FA=OFF), the largest part of the build, which the check does not need.
set -eu
DEVICE=.device
WORK=${DEVICE_WORK:-/tmp/specpipe-device}
SITE=$WORK/site
VERSION=0.3.36
PYTHON=${PYTHON:-python3}
CUDA_ARCHITECTURES=${CUDA_ARCHITECTURES:-90}
BACKEND=${BACKEND:-cuda}  # cpu: the same steps on a machine without a GPU (to try the bundle)
case "$BACKEND" in
  cuda) FLAGS="-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=$CUDA_ARCHITECTURES -DGGML_CUDA_FA=OFF" ;;
  cpu) FLAGS="" ;;
  *) echo "BACKEND=$BACKEND: the device check builds cuda or cpu" >&2; exit 2 ;;
esac
# The kernels every build keeps off (the Makefile's LLAMA_CFLAGS and GGML_LLAMAFILE=OFF): AMX on x86.
case "$(uname -m)" in
  x86_64|amd64) NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
                FLAGS="$FLAGS -DCMAKE_C_FLAGS='$NO_AMX' -DCMAKE_CXX_FLAGS='$NO_AMX'" ;;
esac

build() {
  [ -f "$DEVICE/llama-cpp-python-$VERSION-cuda-src.tar.gz" ] || { echo "no $DEVICE bundle: run make device-bundle first" >&2; exit 2; }
  [ -d "$WORK/src" ] || { mkdir -p "$WORK/src.partial" && tar -xzf "$DEVICE/llama-cpp-python-$VERSION-cuda-src.tar.gz" -C "$WORK/src.partial" && mv "$WORK/src.partial" "$WORK/src"; }
  rm -rf "$WORK/wheel" "$SITE" && mkdir -p "$WORK/wheel"
  CMAKE_ARGS="$FLAGS -DGGML_LLAMAFILE=OFF -DLLAVA_BUILD=OFF -DGGML_NATIVE=ON" \
  CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
    "$PYTHON" -m pip wheel --no-build-isolation --no-deps --no-index --config-settings=build-dir="$WORK/build" \
      -w "$WORK/wheel" "$WORK/src/llama_cpp_python-$VERSION"
  "$PYTHON" -m pip install --quiet --no-index --no-deps --no-compile --target "$SITE" "$WORK"/wheel/*.whl "$DEVICE"/wheels/*.whl
  echo "built: $(ls "$WORK"/wheel)"
}

run() {
  [ -d "$SITE/llama_cpp" ] || { echo "no build in $SITE: run tools/device_check.sh build first" >&2; exit 2; }
  # -X faulthandler: a native crash (the first run's segmentation fault) leaves every thread's Python stack
  PYTHONPATH="$SITE:." PYTHONUNBUFFERED=1 "$PYTHON" -X faulthandler -m benchmarks.device_check --out "$1" --work "$WORK/model" ${SHAPE:+--shape "$SHAPE"}
}

case "${1:-}" in
  build) build ;;
  run) [ $# -eq 2 ] || { echo "usage: tools/device_check.sh run OUT" >&2; exit 2; }; run "$2" ;;
  *) echo "usage: tools/device_check.sh build | run OUT" >&2; exit 2 ;;
esac
