#!/usr/bin/env bash
# Train megactx-tiny on one GPU with `megactx train --recipe tiny`, and the ablations its
# evaluation report compares, then export what models/megactx-tiny ships.
#
#   scripts/train-megactx-tiny.sh [OUT]          # default OUT=runs/tiny
#   SCALE=0.01 scripts/train-megactx-tiny.sh runs/probe   # every step of the pipeline, ~1% of the steps
#   SEED=1 PATTERN=FSFSSSSS scripts/train-megactx-tiny.sh runs/tiny-b   # another seed / IndexShare pattern
#   (also COPY_FORMS=half, TOPK=256, STAGE_STEPS=extend=120, SELECT_FP8=1, COMPILE=1, CHUNK_MB=2048, YARN_FACTOR=32:
#   megactx train --copy-forms, --topk, --stage-steps, --select-fp8, --compile, --chunk-mb, --yarn-factor)
#   HF_OVERRIDES='{"num_hidden_layers": 8, "n_routed_experts": 8}' PATTERN=FSSSSSSF \
#     scripts/train-megactx-tiny.sh runs/tiny8   # the 8-layer model of before (megactx train --hf-overrides)
#
# Order (each line a `megactx train` call; every stage resumes its own checkpoint, so re-running
# the script continues an interrupted run):
#   1. backbone: dense
#   2. warmup (the kept indexers only, on the attention of the layers each serves) and sparse
#      (IndexShare), and beside them, as concurrent processes on the same GPU, the held-out loss
#      ablations at equal budget: warmup and sparse with an indexer in every layer
#      (--attention dsa), and sparse with dense attention (--attention dense)
#   3. extend at CONTEXT tokens (default 65536; "auto" = the longest that fits CONTEXT_BUDGET minutes),
#      then indexers there (the backbone frozen, its indexers trained on, the needle answers'
#      attention weighed apart)
#   4. MTP (mtp_warmup, mtp), three variants at once: CE without IndexShare/KVShare (the ladder's
#      baseline), CE with, and CE + the end-to-end TV loss with (the ladder's TV rung and the shipped
#      layer: at equal budget it drafts better than the TV loss alone, docs/megactx-tiny.md)
#   5. export: the backbone with the MTP_SHIP variant's MTP layer to OUT/export/megactx-tiny,
#      each variant's MTP layer alone to OUT/export/mtp-ablations/mtp-<variant>.safetensors (what
#      `megactx bench spec --mtp-layers` reads for the acceptance-length ladder; the CE + TV layer as
#      the TV rung's mtp-tv-share)
# A 10M-parameter model leaves most of an H200 idle, so the concurrent processes cost little time;
# expandable segments keep the processes' caching allocators from fragmenting the shared memory.
# TIME_BUDGET=9 stops the script after about 9 minutes, every stage at a checkpoint (megactx train
# --time-limit); the same command again continues (for machines lent a few minutes at a time).
# ABLATIONS=0 leaves out the held-out loss ablations (DSA, dense) of step 2.
# On a machine with more GPUs, ABLATION_DEVICES=1 runs the ablations and the MTP variants other than
# MTP_SHIP there (their CUDA_VISIBLE_DEVICES), so the shipped model's stages have a GPU to themselves.
set -euo pipefail

OUT=${1:-runs/tiny}
SCALE=${SCALE:-1}
CONTEXT=${CONTEXT:-65536}
MTP_SHIP=${MTP_SHIP:-cetv-share}
PY=${PYTHON:-python3}
ABLATIONS=${ABLATIONS:-1}
TIME_BUDGET=${TIME_BUDGET:-}
START=$(date +%s)
RECIPE=(--seed "${SEED:-0}")
if [[ -n ${COPY_FORMS:-} ]]; then RECIPE+=(--copy-forms "$COPY_FORMS"); fi
if [[ ${SELECT_FP8:-0} == 1 ]]; then RECIPE+=(--select-fp8); fi
if [[ ${COMPILE:-0} == 1 ]]; then RECIPE+=(--compile); fi
if [[ -n ${CHUNK_MB:-} ]]; then RECIPE+=(--chunk-mb "$CHUNK_MB"); fi
if [[ -n ${TOPK:-} ]]; then RECIPE+=(--topk "$TOPK"); fi
if [[ -n ${PATTERN:-} ]]; then RECIPE+=(--pattern "$PATTERN"); fi
if [[ -n ${STAGE_STEPS:-} ]]; then RECIPE+=(--stage-steps "$STAGE_STEPS"); fi
if [[ -n ${HF_OVERRIDES:-} ]]; then RECIPE+=(--hf-overrides "$HF_OVERRIDES"); fi
if [[ -n ${YARN_FACTOR:-} ]]; then RECIPE+=(--yarn-factor "$YARN_FACTOR"); fi
LOGS="$OUT/logs"
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
mkdir -p "$LOGS"

left() { awk -v b="$TIME_BUDGET" -v e="$(( $(date +%s) - START ))" 'BEGIN { printf "%.2f", b - e / 60 }'; }
train() {
  local budget=()
  if [[ -n $TIME_BUDGET ]]; then budget=(--time-limit "$(left)"); fi
  "$PY" -m megactx train --recipe tiny --out "$OUT" --steps-scale "$SCALE" "${RECIPE[@]}" --no-progress \
    "${budget[@]}" "$@"
}
stamp() { echo "[$(date +%H:%M:%S)] $*"; }
on_time() {  # with TIME_BUDGET: stop (after the running stages) once less than a minute is left
  if [[ -n $TIME_BUDGET ]] && awk -v l="$(left)" 'BEGIN { exit !(l < 1) }'; then
    wait
    stamp "TIME_BUDGET spent: run the same command again to continue"
    exit 0
  fi
}
aside() {  # an ablation: on ABLATION_DEVICES when given
  if [[ -n ${ABLATION_DEVICES:-} ]]; then CUDA_VISIBLE_DEVICES=$ABLATION_DEVICES train "$@"; else train "$@"; fi
}

stamp "data"
"$PY" -m megactx.train.data "$OUT/data" --snapshot

stamp "backbone: dense"
train --stages dense 2>&1 | tee "$LOGS/backbone.log"
on_time

ablations=()
if [[ $ABLATIONS == 1 ]]; then
  stamp "warmup, sparse (+ ablations: dsa, dense)"
  aside --stages warmup,sparse --attention dsa > "$LOGS/sparse-dsa.log" 2>&1 &
  ablations+=($!)
  aside --stages sparse --attention dense > "$LOGS/sparse-dense.log" 2>&1 &
  ablations+=($!)
else
  stamp "warmup, sparse"
fi
train --stages warmup,sparse 2>&1 | tee "$LOGS/sparse.log"
on_time

stamp "extend and indexers at $CONTEXT"
extend=(--context "$CONTEXT")
if [[ $CONTEXT == auto && -n ${CONTEXT_BUDGET:-} ]]; then extend+=(--context-budget "$CONTEXT_BUDGET"); fi
train --stages extend,indexers "${extend[@]}" 2>&1 | tee "$LOGS/extend.log"
on_time

stamp "MTP variants"
declare -A MTP=([ce-noshare]="--mtp-loss ce --no-mtp-share" [ce-share]="--mtp-loss ce --mtp-share"
                [cetv-share]="--mtp-loss ce+tv --mtp-share")
declare -A RUNG_FILE=([cetv-share]=tv-share)  # the ladder's file names (benchmarks/spec.py's rungs)
pids=()
for variant in "${!MTP[@]}"; do
  run=aside; [[ $variant == "$MTP_SHIP" ]] && run=train
  # shellcheck disable=SC2086
  $run --stages mtp_warmup,mtp ${MTP[$variant]} > "$LOGS/mtp-$variant.log" 2>&1 &
  pids+=($!)
done
for pid in "${pids[@]}" "${ablations[@]}"; do wait "$pid"; done
on_time

stamp "export"
mkdir -p "$OUT/export/mtp-ablations"
for variant in "${!MTP[@]}"; do
  "$PY" -c "import sys; from megactx.train.recipe import export_mtp_layer; export_mtp_layer(sys.argv[1], sys.argv[2])" \
    "$OUT/mtp-$variant/checkpoint" "$OUT/export/mtp-ablations/mtp-${RUNG_FILE[$variant]:-$variant}.safetensors"
done
# shellcheck disable=SC2086
train --stages mtp ${MTP[$MTP_SHIP]} --export "$OUT/export/megactx-tiny" 2>&1 | tail -1
stamp "done"
