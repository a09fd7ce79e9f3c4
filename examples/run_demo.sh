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
PYTHON="${PYTHON:-python}"
DATA_DIR="${MTRAINING_DATA:-$REPO_ROOT/data}"
SOURCES="${DEMO_SOURCES:-books}"
WORKERS="${DEMO_WORKERS:-2}"
CORPUS_NAME="${SOURCES//,/_}"

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

# TRAIN STEP (owned by pretrain_gpt.py author)
# Call examples/pretrain_gpt.py here with "$DATA_PREFIX" and "$TOKENIZER_MODEL".
