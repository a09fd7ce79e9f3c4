#!/usr/bin/env bash
# Check that the MTraining patch for a Megatron-LM checkout's release line applies to it.
#
#   usage: tools/check_patch.sh /path/to/Megatron-LM [PATCH]
#
# Without PATCH the patch is picked from the checkout's tag (`git describe --tags`):
#   core_v0.16.x -> patches/megatron-lm-core_v0.16.patch, core_v0.17.x -> ..._v0.17.patch, and so on
#   for every patches/megatron-lm-core_v<line>.patch (its "Tested tags:" line lists the tags it was
#   checked on).
# A checkout whose tag has no patch (or no tag) is matched by megatron/core/package_info.py instead:
# Megatron-LM main (megatron-core 0.20 in its tree, no 0.20 tag; `git describe` names an old tag)
# -> patches/megatron-lm-core_v0.20.patch (tested tags: main). Anything else is an error listing the
# supported tags (exit 1); pass PATCH to try a patch on such a checkout anyway.
#
# Runs `git apply --check` (read-only: nothing in the checkout changes) and reports one of
#   OK       the patch applies cleanly            -> apply it with: git -C DIR apply PATCH   (exit 0)
#   APPLIED  the patch is already applied (its reverse applies)                               (exit 0)
#   FAIL     it does not apply (git's message follows; exit 1)
# Exit 2: bad usage (no such directory or patch).
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PATCHES="$HERE/patches"
DIR="${1:-}"
PATCH="${2:-}"

supported_tags() {
  local p tags=()
  for p in "$PATCHES"/megatron-lm-core_v*.patch; do
    [ -f "$p" ] || continue
    tags+=($(sed -n 's/^Tested tags: *//p' "$p"))
  done
  echo "${tags[*]}"
}

usage() {
  echo "usage: $0 MEGATRON_LM_DIR [PATCH]   (MEGATRON_LM_DIR: a checkout of NVIDIA/Megatron-LM at one of: $(supported_tags))" >&2
}
# bad usage: the usage line, then one error line naming the argument (exit 2)
usage_error() { usage; echo "$(basename "$0"): error: $*" >&2; exit 2; }

if [ -z "$DIR" ]; then usage; exit 2; fi
if [ ! -e "$DIR" ]; then usage_error "MEGATRON_LM_DIR $DIR: directory not found"; fi
if [ ! -d "$DIR" ]; then usage_error "MEGATRON_LM_DIR $DIR: not a directory (give the Megatron-LM checkout)"; fi
if [ -n "$PATCH" ] && [ ! -f "$PATCH" ]; then usage_error "PATCH $PATCH: patch not found"; fi
for f in pretrain_gpt.py gpt_builders.py; do
  [ -f "$DIR/$f" ] || { echo "FAIL: $DIR/$f not found: is $DIR a Megatron-LM checkout?"; exit 1; }
done

if [ -e "$DIR/.git" ] && desc=$(git -C "$DIR" describe --tags 2>/dev/null); then
  echo "checkout: $DIR at $desc ($(git -C "$DIR" rev-parse HEAD))"
else
  desc=""
  echo "checkout: $DIR (no git tag found: not a git checkout, or no tags fetched)"
fi

if [ -z "$PATCH" ]; then
  line=$(printf '%s' "$desc" | sed -n 's/^core_v\([0-9][0-9]*\.[0-9][0-9]*\).*/\1/p')
  PATCH="$PATCHES/megatron-lm-core_v${line}.patch"
  info="$DIR/megatron/core/package_info.py"
  if { [ -z "$line" ] || [ ! -f "$PATCH" ]; } && [ -f "$info" ]; then
    tree=$(sed -n 's/^MAJOR *= *\([0-9][0-9]*\).*/\1/p' "$info").$(sed -n 's/^MINOR *= *\([0-9][0-9]*\).*/\1/p' "$info")
    if [ -f "$PATCHES/megatron-lm-core_v${tree}.patch" ] && grep -q '^Tested tags: main$' "$PATCHES/megatron-lm-core_v${tree}.patch"; then
      echo "note: megatron-core $tree in the tree (megatron/core/package_info.py): Megatron-LM main"
      line=$tree
      desc=""
      PATCH="$PATCHES/megatron-lm-core_v${line}.patch"
    fi
  fi
  if [ -z "$line" ] || [ ! -f "$PATCH" ]; then
    echo "FAIL: Megatron-LM ${desc:-(no tag)} is not supported; supported tags: $(supported_tags)"
    echo "  (check out one of them, or pass a patch as the second argument to try it on this checkout)"
    exit 1
  fi
  past=$(printf '%s' "$desc" | sed -n 's/.*-\([0-9][0-9]*\)-g[0-9a-f]*$/\1/p')
  [ -n "$past" ] && echo "note: the checkout is $past commits past ${desc%-*-g*}; the ${line} patch may still apply"
fi
PATCH="$(cd "$(dirname "$PATCH")" && pwd)/$(basename "$PATCH")"
echo "patch: $(basename "$PATCH") (tested tags: $(sed -n 's/^Tested tags: *//p' "$PATCH"))"

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
