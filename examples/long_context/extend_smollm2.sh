#!/usr/bin/env bash
# Long-context extension of SmolLM2-135M: ONE resumable call of tools/extend_context.py.
#
#   MODE=dense|mtraining [SEQ=32768] [ITERS=80] [GBS=8] [BUDGET=540] [STOP_ITER=N] [CONFIG=yaml] [DRY_RUN=1] \
#       examples/long_context/extend_smollm2.sh [more pretrain_gpt.py flags]
#
# Call it again with the same MODE/SEQ/ITERS to continue: the first call loads the converted release
# checkpoint (checkpoints/smollm2_135m), later calls resume checkpoints/long_context/<mode>_<seq/1024>k
# (iteration, optimizer, LR schedule and data position continue exactly; a finished run is a no-op).
# BUDGET: seconds of this process (start-up and the final save included) -> stop and save in time.
# RoPE: base raised by SmolLM2's own ABF step (x10 per x4 context): 32K -> 1e6, 64K -> 3.2e6.
# Data: tools/build_long_context_data.py (data/long_context for 32K, data/long_context_64k for 64K).
set -euo pipefail
cd "$(dirname "$0")/../.."
SEQ=${SEQ:-32768}
if [ "$SEQ" -gt 32768 ]; then DATA=${DATA:-data/long_context_64k/train_text_document}; fi
DATA=${DATA:-data/long_context/train_text_document}
args=(--mode "${MODE:?set MODE=dense or MODE=mtraining}" --seq "$SEQ" --train-iters "${ITERS:-80}" --global-batch-size "${GBS:-8}"
      --data-prefix "$DATA")
if [ -n "${BUDGET:-540}" ]; then args+=(--time-budget-s "${BUDGET:-540}"); fi
if [ -n "${STOP_ITER:-}" ]; then args+=(--stop-iter "$STOP_ITER"); fi
# CONFIG: another mtraining config (default configs/long_context_r095.yaml), e.g. a recall-0.98 copy
if [ -n "${CONFIG:-}" ]; then args+=(--mtraining-config "$CONFIG"); fi
if [ -n "${DRY_RUN:-}" ]; then args+=(--dry-run); fi
exec "${PYTHON:-python3}" tools/extend_context.py "${args[@]}" -- "$@"
