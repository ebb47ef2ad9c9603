#!/usr/bin/env bash
# The kernels compiled for real GPUs, on the CPU, with the Triton a GPU install gets.
#
#   tools/check_gpu_compile.sh [args of tools/check_gpu_compile.py]   (needs .venv, as `make test` sets it up)
#   GRID=full tools/check_gpu_compile.sh                               (every shape: ~10 min instead of ~2)
#   TRITON_VERSIONS="3.8.0 3.7.1" tools/check_gpu_compile.sh           (vLLM 0.32's Triton too)
#
# .venv's Triton is whatever pip picked for the CPU build; on a GPU, Triton is the one the torch of
# the `gpu` extra pins: vLLM 0.33.0 requires torch==2.14.0, which requires triton~=3.8.0 (3.8.0);
# vLLM 0.32.0 requires torch==2.13.0, which requires triton==3.7.1 (the wheels' registry metadata).
# .venv-triton/<version> (gitignored, made once, ~0.7-0.9 GB) holds that Triton alone, over .venv's
# packages (its CPU torch, which the launchers import, and the plugin), as .venv-0.33 does for
# tools/check_vllm_033.sh. Its own site-packages come first on sys.path, so its Triton, with its own
# ptxas, is the one imported. No GPU or driver is involved.
#
# For each version, tools/check_gpu_compile.py compiles the specializations the tree-attention and
# KV-move launchers can produce for sm_80 and sm_90, and fails on a compile error, a register
# shortage or shared memory over the device's limit (its docstring: what is compiled and how).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
BASE=${BASE_VENV:-.venv}
DIR=${VENV_TRITON:-.venv-triton}
TRITON_VERSIONS=${TRITON_VERSIONS:-3.8.0}  # vLLM 0.33's: what `pip install .[gpu]` gets today
GRID=${GRID:-ci}
PYVER=$("$BASE/bin/python" -c 'import sys; print(f"python{sys.version_info[0]}.{sys.version_info[1]}")')
BASE_SITE=$(cd "$BASE/lib/$PYVER/site-packages" && pwd)

status=0
for version in $TRITON_VERSIONS; do
  VENV=$DIR/$version
  SITE=$VENV/lib/$PYVER/site-packages
  if [ ! -f "$VENV/.installed" ]; then
    echo "== $VENV: Triton $version over $BASE's packages"
    rm -rf "$VENV"
    "$("$BASE/bin/python" -c 'import sys; print(sys.base_prefix)')/bin/$PYVER" -m venv --without-pip "$VENV"
    "$BASE/bin/python" -m pip install --quiet --no-deps --target "$SITE" "triton==$version"
    echo "import site; site.addsitedir('$BASE_SITE')" > "$SITE/zz_base_venv.pth"
    touch "$VENV/.installed"
  fi
  echo "== Triton $version: every specialization for sm_80 and sm_90 ($GRID grid)"
  "$VENV/bin/python" tools/check_gpu_compile.py --expect-triton "$version" --grid "$GRID" "$@" || status=1
done
echo "== GPU compile check $([ $status = 0 ] && echo passed || echo FAILED) in ${SECONDS}s"
exit $status
