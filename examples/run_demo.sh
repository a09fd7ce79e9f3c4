#!/usr/bin/env bash
# End-to-end demo: fetch a real corpus + tokenizer, tokenize it for Megatron-Core, then train.
#
# Environment (all optional):
#   PYTHON          interpreter to use (default: python)
#   MTRAINING_DATA  data cache directory (default: <repo>/data; never committed)
#   DEMO_SOURCES    prepare_corpus.py --sources value (default: books; e.g. books,austen,bible or all)
#   DEMO_WORKERS    tokenizer processes for preprocess_data.py (default: 2)
# Both data steps are cached, so re-running only repeats the training step.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"
export PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}"   # this checkout's megatron_mtraining
PYTHON="${PYTHON:-python}"
DATA_DIR="${MTRAINING_DATA:-$REPO_ROOT/data}"
SOURCES="${DEMO_SOURCES:-books}"
WORKERS="${DEMO_WORKERS:-2}"
CORPUS_NAME="${SOURCES//,/_}"
if ! [[ "${DEMO_TRAIN_ITERS:-30}" =~ ^[1-9][0-9]*$ ]]; then
    echo "run_demo.sh: DEMO_TRAIN_ITERS must be a positive integer, got '${DEMO_TRAIN_ITERS}'" >&2
    exit 2
fi
# The demo replaces only a checkpoint directory it made itself (marked by MARKER; at the default
# location also one an earlier demo left without the marker), checked before any work starts.
CKPT_DIR="${DEMO_CKPT:-$REPO_ROOT/checkpoints/demo}"
MARKER=".mtraining_demo_checkpoint"
if [ -e "$CKPT_DIR" ] && [ ! -f "$CKPT_DIR/$MARKER" ] && [ "$CKPT_DIR" != "$REPO_ROOT/checkpoints/demo" ] \
        && { [ ! -d "$CKPT_DIR" ] || [ -n "$(ls -A "$CKPT_DIR" 2>/dev/null)" ]; }; then
    echo "run_demo.sh: DEMO_CKPT=$CKPT_DIR exists and was not made by this demo; choose an empty or new" \
         "directory (the demo replaces its own checkpoint on every run)" >&2
    exit 2
fi

echo "== data 1/2: corpus + tokenizer ($SOURCES) -> $DATA_DIR"
"$PYTHON" tools/prepare_corpus.py --sources "$SOURCES" --name "$CORPUS_NAME" --out-dir "$DATA_DIR"

echo "== data 2/2: tokenize -> $DATA_DIR/megatron/${CORPUS_NAME}_text_document.{bin,idx}"
"$PYTHON" tools/preprocess_data.py \
    --input "$DATA_DIR/corpus/$CORPUS_NAME.jsonl" \
    --json-keys text \
    --output-prefix "$DATA_DIR/megatron/$CORPUS_NAME" \
    --tokenizer-type SentencePieceTokenizer \
    --tokenizer-model "$DATA_DIR/tokenizer/mistral_v1.model" \
    --append-eod \
    --workers "$WORKERS"

# Inputs for the training step: the indexed-dataset prefix (no .bin/.idx suffix) and the
# sentencepiece model the ids were made with.
export DATA_PREFIX="$DATA_DIR/megatron/${CORPUS_NAME}_text_document"
export TOKENIZER_MODEL="$DATA_DIR/tokenizer/mistral_v1.model"

# Training step (examples/pretrain_gpt.py).
# A 4-layer GQA GPT (hidden 256, 8 query heads / 2 KV groups, SwiGLU ffn 768, RoPE, RMSNorm,
# untied 32k-vocab embeddings; ~19M parameters) trained on 4096-token sequences that are split over
# CP=2 CPU processes (gloo): striped layout (granularity 64), exact ring attention
# (--cp-attention mtraining). One sequence per iteration; the loss falls from ~10.4 (= ln 32000)
# to about 6.5 (noisy, single sequences) within 30 iterations.
# The final checkpoint (megatron.core dist_checkpointing: model + optimizer + LR schedule +
# iteration) goes to checkpoints/demo.
#   DEMO_TRAIN_ITERS  iterations (default 30)      DEMO_CKPT  checkpoint directory (default checkpoints/demo;
#                     replaced on every run, so it must be new, empty or an earlier demo checkpoint)
#   DEMO_CONFIG       an MTraining config, e.g. configs/demo_sparse.yaml (online vertical-slash sparsity);
#                     default: none (the exact dense striped ring)
TRAIN_ITERS="${DEMO_TRAIN_ITERS:-30}"
WARMUP_ITERS=$(( TRAIN_ITERS > 3 ? 3 : TRAIN_ITERS - 1 ))   # the warm-up must end before the decay does
# Without a config: the dense striped ring, granularity 64. A config sets the layout itself.
CONFIG_ARGS=(--cp-layout striped --cp-granularity 64)
if [ -n "${DEMO_CONFIG:-}" ]; then
    CONFIG_ARGS=(--mtraining-config "$DEMO_CONFIG")
fi

export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"   # 2 ranks on 2 cores
# glibc malloc: keep freed large blocks instead of unmapping them after every op (the attention
# and logit buffers would be page-faulted in again each step; ~2x faster on CPU, same results).
export MALLOC_MMAP_THRESHOLD_="${MALLOC_MMAP_THRESHOLD_:-17179869184}"
export MALLOC_TRIM_THRESHOLD_="${MALLOC_TRIM_THRESHOLD_:-17179869184}"
export MALLOC_TOP_PAD_="${MALLOC_TOP_PAD_:-1073741824}"
if [ -e "$CKPT_DIR" ]; then
    echo "== train: removing the previous demo checkpoint $CKPT_DIR"
    rm -rf "$CKPT_DIR"
fi
mkdir -p "$CKPT_DIR"
touch "$CKPT_DIR/$MARKER"
echo "== train: $TRAIN_ITERS iterations, seq 4096, CP=2 (2 processes) -> $CKPT_DIR"
start=$(date +%s)
"$PYTHON" -m torch.distributed.run --standalone --nproc-per-node 2 examples/pretrain_gpt.py \
    --num-layers 4 --hidden-size 256 --ffn-hidden-size 768 --swiglu \
    --num-attention-heads 8 --group-query-attention --num-query-groups 2 \
    --seq-length 4096 --max-position-embeddings 4096 \
    --position-embedding-type rope --rotary-base 10000 --normalization RMSNorm \
    --untie-embeddings-and-output-weights --disable-bias-linear \
    --tensor-model-parallel-size 1 --context-parallel-size 2 \
    --cp-attention mtraining \
    --micro-batch-size 1 --global-batch-size 1 --train-iters "$TRAIN_ITERS" \
    --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters "$WARMUP_ITERS" \
    --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 --seed 1234 \
    --data-path "$DATA_PREFIX" --split 90,10,0 \
    --tokenizer-type SentencePieceTokenizer --tokenizer-model "$TOKENIZER_MODEL" \
    --log-interval 1 --eval-interval "$TRAIN_ITERS" --eval-iters 1 \
    --save "$CKPT_DIR" "${CONFIG_ARGS[@]}"
echo "== train: done in $(( $(date +%s) - start )) s; checkpoint: $CKPT_DIR/iter_$(printf %07d "$TRAIN_ITERS")"
