#!/usr/bin/env bash
# clang-format over the tracked C, C++ and CUDA sources (.clang-format at the root).
#   scripts/format.sh           rewrite the files in place
#   scripts/format.sh --check   change nothing; list the files that differ and exit 1 if any does
# CLANG_FORMAT picks the binary (default: clang-format, installed by scripts/setup.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
CLANG_FORMAT=${CLANG_FORMAT:-clang-format}
command -v "$CLANG_FORMAT" >/dev/null 2>&1 || { echo "format.sh: $CLANG_FORMAT not found (scripts/setup.sh installs it)"; exit 2; }
mapfile -t files < <(git ls-files '*.h' '*.c' '*.cpp' '*.cu' '*.cuh')
case ${1:-} in
  --check)
    bad=()
    for f in "${files[@]}"; do
      "$CLANG_FORMAT" --dry-run --Werror "$f" >/dev/null 2>&1 || bad+=("$f")
    done
    if [ ${#bad[@]} -gt 0 ]; then
      printf 'format.sh: not clang-formatted (%s): %s\n' "$("$CLANG_FORMAT" --version)" "${bad[*]}"
      echo "format.sh: run scripts/format.sh to fix them"
      exit 1
    fi
    echo "format.sh: ${#files[@]} files clang-formatted"
    ;;
  "") "$CLANG_FORMAT" -i "${files[@]}" ;;
  *) sed -n '2,5p' "$0"; exit 2 ;;
esac
