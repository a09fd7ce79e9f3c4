#!/usr/bin/env bash
# Evaluate base / dense / mtraining checkpoints of the long-context extension with
# tools/eval_long_context.py: perplexity by position on the held-out long documents
# (data/long_context/heldout_text_document, document-disjoint from training) and needle-in-a-haystack.
#
#   WHICH=base|dense|mtraining [SEQ=32768] [OUTDIR=runs/long_context] [ATTN=dense|sparse] [CONFIG=yaml] [DRY_RUN=1] \
#       examples/long_context/eval_smollm2.sh [more eval_long_context.py flags]
#
# The RoPE base must be the one the checkpoint was trained with (the tool checks it): base 1e5
# (SmolLM2 as converted, 8K), extended runs tools/extend_context.abf_rotary_base(SEQ).
# ATTN=dense: the exact dense striped ring (SDPA at CP=1 on GPU); ATTN=sparse: the run's
# vertical-slash config at inference as well (CONFIG=, default configs/long_context_r095.yaml: pass the
# config the run was trained with, e.g. CONFIG=configs/long_context_r098.yaml).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
SEQ=${SEQ:-32768}
WHICH=${WHICH:?set WHICH=base, dense or mtraining}
OUTDIR=${OUTDIR:-runs/long_context}
if [ "$SEQ" -gt 32768 ]; then HELDOUT=${HELDOUT:-data/long_context_64k/heldout_text_document}; fi
HELDOUT=${HELDOUT:-data/long_context/heldout_text_document}
FLAGS=$(sed -e 's/--load [^ ]*//' -e 's/--rotary-base [^ ]*//' checkpoints/smollm2_135m/pretrain_flags.txt)
if [ "$WHICH" = base ]; then
  CKPT=checkpoints/smollm2_135m; ROPE=100000
else
  CKPT=checkpoints/long_context/${WHICH}_$((SEQ / 1024))k
  ROPE=$("$PY" -c "import runpy; print(runpy.run_path('tools/extend_context.py')['abf_rotary_base']($SEQ))")
fi
CFG=()
if [ "${ATTN:-dense}" = sparse ]; then CFG=(--mtraining-config "${CONFIG:-configs/long_context_r095.yaml}"); fi
TAG=${WHICH}_$((SEQ / 1024))k_${ATTN:-dense}
CURVES=()
for m in dense mtraining; do
  f=checkpoints/long_context/${m}_$((SEQ / 1024))k/metrics.jsonl
  if [ -f "$f" ]; then CURVES+=("$m=$f"); fi
done
mkdir -p "$OUTDIR"
cmd=("$PY" tools/eval_long_context.py "$CKPT" $FLAGS --rotary-base "$ROPE" --seq-length "$SEQ"
     --data-path "$HELDOUT" --split 100,0,0 --eval-split all --eval-seq-length "$SEQ" --max-windows "${WINDOWS:-32}"
     --niah-lengths "${NIAH_LENGTHS:-8K,16K,32K}" --niah-depths "${NIAH_DEPTHS:-0,50,100}" --max-new-tokens 24
     --niah-template "${TEMPLATE:-chatml}" "${CFG[@]}" --bf16
     --json "$OUTDIR/eval_$TAG.json" --plots "$OUTDIR/plots_$TAG")
if [ "${#CURVES[@]}" -gt 0 ]; then cmd+=(--loss-curves "${CURVES[@]}"); fi
cmd+=("$@")
echo "${cmd[*]}"
if [ -n "${DRY_RUN:-}" ]; then exit 0; fi
exec "${cmd[@]}"
