#!/usr/bin/env bash
# Check that patches/megatron-lm-core_v0.16.1.patch applies to a Megatron-LM checkout.
#
#   usage: tools/check_patch.sh /path/to/Megatron-LM [PATCH]
#
# Runs `git apply --check` (read-only: nothing in the checkout changes) and reports one of
#   OK       the patch applies cleanly            -> apply it with: git -C DIR apply PATCH   (exit 0)
#   APPLIED  the patch is already applied (its reverse applies)                               (exit 0)
#   FAIL     it does not apply (git's message follows; exit 1)
# and the checkout's commit compared with core_v0.16.1 (55ac7082517c), the commit the patch was
# made against. Exit 2: bad usage (no such directory or patch).
set -uo pipefail
TAG=core_v0.16.1
TAG_COMMIT=55ac7082517c3878ae653c07c09c534b8aed49f6
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="${1:-}"
PATCH="${2:-$HERE/patches/megatron-lm-core_v0.16.1.patch}"
if [ -z "$DIR" ] || [ ! -d "$DIR" ]; then
  echo "usage: $0 MEGATRON_LM_DIR [PATCH]   (MEGATRON_LM_DIR: a checkout of NVIDIA/Megatron-LM, tag $TAG)" >&2
  exit 2
fi
if [ ! -f "$PATCH" ]; then echo "patch not found: $PATCH" >&2; exit 2; fi
PATCH="$(cd "$(dirname "$PATCH")" && pwd)/$(basename "$PATCH")"
for f in pretrain_gpt.py gpt_builders.py; do
  [ -f "$DIR/$f" ] || { echo "FAIL: $DIR/$f not found: is $DIR a Megatron-LM checkout?"; exit 1; }
done

if head=$(git -C "$DIR" rev-parse HEAD 2>/dev/null); then
  if [ "$head" = "$TAG_COMMIT" ]; then
    echo "checkout: $DIR at $head ($TAG)"
  else
    echo "checkout: $DIR at $head (not $TAG = $TAG_COMMIT; the patch may still apply)"
  fi
else
  echo "checkout: $DIR (not a git repository; checking the files as they are)"
fi

if out=$(cd "$DIR" && git apply --check "$PATCH" 2>&1); then
  echo "OK: $(basename "$PATCH") applies cleanly (touches: $(grep '^diff --git' "$PATCH" | awk '{print substr($3,3)}' | tr '\n' ' '))"
  echo "apply with: git -C $DIR apply $PATCH"
  exit 0
fi
if (cd "$DIR" && git apply --check --reverse "$PATCH" >/dev/null 2>&1); then
  echo "APPLIED: $(basename "$PATCH") is already applied in $DIR (undo with: git -C $DIR apply -R $PATCH)"
  exit 0
fi
echo "FAIL: $(basename "$PATCH") does not apply to $DIR:"
echo "$out"
exit 1
