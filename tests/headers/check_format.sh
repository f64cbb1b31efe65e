#!/usr/bin/env bash
# include/ follows .clang-format: clang-format would change nothing, and no line is longer than
# the column limit (clang-format leaves some lines long, such as an unbreakable comment).
#   check_format.sh SOURCE_ROOT      exit 0 when formatted, 1 otherwise, 77 (skip) without clang-format
set -u
root=$1
cf=$(command -v clang-format || command -v clang-format-14 || true)
if [[ -z $cf ]]; then echo "clang-format not found: skipped (scripts/deps.sh installs it)"; exit 77; fi
cd "$root"
limit=$(sed -n 's/^ColumnLimit: *\([0-9]*\).*/\1/p' .clang-format)
mapfile -t files < <(find include -name '*.hpp' | sort)
fail=0
if ! "$cf" --dry-run -Werror "${files[@]}" 2> /tmp/ddp-format.$$; then
  grep 'error:' /tmp/ddp-format.$$ | head -20
  echo "FAIL: $(grep -c 'error:' /tmp/ddp-format.$$) places differ from .clang-format; run: clang-format -i \$(find include -name '*.hpp')"
  fail=1
fi
rm -f /tmp/ddp-format.$$
long=$(awk -v n="$limit" 'length > n { print FILENAME ":" FNR ": " length " columns" }' "${files[@]}")
if [[ -n $long ]]; then echo "$long" | head -20; echo "FAIL: lines over $limit columns"; fail=1; fi
[[ $fail -eq 0 ]] && echo "${#files[@]} headers formatted, no line over $limit columns"
exit $fail
