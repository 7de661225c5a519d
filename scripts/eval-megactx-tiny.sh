#!/usr/bin/env bash
# The evaluation report of megactx-tiny, from a run of scripts/train-megactx-tiny.sh (GPU).
#
#   scripts/eval-megactx-tiny.sh [RUN] [OUT]     # default RUN=runs/tiny, OUT=RUN/eval
#
# Environment: PARTS (which of bpb,search,needles,needles-yarn,recall to run; default all), SEED (0), CASES (200 needle cases a task and context), CONTEXTS (needle contexts,
# default 4k,16k,64k,128k,256k: the trained 64K and past it), BPB_CONTEXTS (1k,4k), INDEX_CACHE_DTYPE
# (the needles' indexer cache: fp8, the default on CUDA, or auto = exact, as training scores). Longer needle
# contexts (512k, 1m) take minutes each: run them apart with `megactx eval needles --contexts`.
#   1. held-out bits per byte at equal budget: IndexShare (sparse), DSA in every layer (sparse-dsa),
#      dense (sparse-dense), and the shipped model after context extension and MTP training
#   2. the training-free IndexShare search from the DSA checkpoint down to a quarter of its layers
#      full, against the uniform 1-in-4 pattern (FSSSFSSSFSSSFSSS at 16 layers), on held-out code and
#      needle tasks (megactx-tiny shares by FSSSFSSSFSSSSSSF, see megactx.train.recipe.tiny_recipe)
#   3. needle retrieval of the shipped model up to and past its trained length (NEEDLE_MODEL: another
#      directory with the same backbone, e.g. a bf16 export of the extend stage, so that the needles
#      may run while the MTP variants train; the MTP stages leave the backbone untouched)
#   3b. the same needles served with YaRN factor YARN_FACTOR (default 32; 64 once trained at 32) instead of the trained one,
#      through --hf-overrides: how far past its trained length the model finds them then
#   4. needle recall at RECALL_CONTEXTS (default 16k,64k), 100 cases each: for the missed needles,
#      whether the retrieving layer's indexer dropped a needle token or the attention missed it
set -euo pipefail

RUN=${1:-runs/tiny}
OUT=${2:-$RUN/eval}
SEED=${SEED:-0}
CASES=${CASES:-200}
PARTS=${PARTS:-bpb,search,needles,needles-yarn,recall}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
stamp() { echo "[$(date +%H:%M:%S)] $*"; }
part() { [[ ,$PARTS, == *",$1,"* ]]; }
needles() {  # the needle evaluation of the shipped model; extra flags (--out, --hf-overrides) follow
  "$PY" -m megactx eval needles --model "${NEEDLE_MODEL:-$RUN/export/megactx-tiny}" --seed "$SEED" --cases "$CASES" \
    --contexts "${CONTEXTS:-4k,16k,64k,128k,256k}" --trained-length 65536 --batch-size 32 \
    --max-num-batched-tokens 65536 ${INDEX_CACHE_DTYPE:+--index-cache-dtype "$INDEX_CACHE_DTYPE"} "$@"
}

if part bpb; then
stamp "bits per byte"
"$PY" -m megactx eval bpb --seed "$SEED" --contexts "${BPB_CONTEXTS:-1k,4k}" --data-dir "$RUN/data" --out "$OUT/bpb" \
  --model "$RUN/sparse/checkpoint" --model "$RUN/sparse-dsa/checkpoint" --model "$RUN/sparse-dense/checkpoint" \
  --model "$RUN/export/megactx-tiny"
fi

if part search; then
stamp "IndexShare search"
LAYERS=$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["num_hidden_layers"])' \
  "$RUN/sparse-dsa/checkpoint/config.json")
UNIFORM=$(printf 'FSSS%.0s' $(seq $(( LAYERS / 4 ))))
"$PY" -m megactx indexshare-search --model "$RUN/sparse-dsa/checkpoint" --data-dir "$RUN/data" --seed "$SEED" \
  --num-full $(( LAYERS / 4 )) --compare "$UNIFORM" --out "$OUT/indexshare-search" --no-progress
fi

if part needles; then
stamp "needles"
needles --out "$OUT/needles"
fi
if part needles-yarn; then
stamp "needles served with a larger YaRN factor (same weights)"
needles --hf-overrides "{\"rope_parameters\": {\"factor\": ${YARN_FACTOR:-32}}}" --out "$OUT/needles-yarn${YARN_FACTOR:-32}"
fi
if part recall; then
stamp "needle recall"
"$PY" -m megactx eval needle-recall --model "${NEEDLE_MODEL:-$RUN/export/megactx-tiny}" --seed "$SEED" --cases 100 \
  --contexts "${RECALL_CONTEXTS:-16k,64k}" ${INDEX_CACHE_DTYPE:+--index-cache-dtype "$INDEX_CACHE_DTYPE"} \
  --no-progress --out "$OUT/needle-recall"
fi
stamp "done: $PARTS"
