#!/usr/bin/env bash
# Runs the given pytest selection once per seed offset (DSV32_TEST_SEED=0..N-1) and prints a pass/fail line per
# seed plus the tests' own printed figures (-s). Use it to set or re-check a statistical bound, e.g.
#   tools/seed_sweep.sh 20 tests/test_indexer.py -k fp8
# Exit status: the number of seeds that failed (0 = all passed).
set -u
n=$1; shift
py=${PY:-.venv/bin/python}
failed=0
for ((s = 0; s < n; s++)); do
  out=$(DSV32_TEST_SEED=$s "$py" -m pytest -q -s -p no:cacheprovider "$@" 2>&1)
  rc=$?
  figures=$(grep -oE "(map|length|warm-up|sparse|fp8 vs exact): [^=]*$" <<<"$out" | tr '\n' ' ')
  if [ $rc -eq 0 ]; then echo "seed $s: pass  $figures"; else echo "seed $s: FAIL  $figures"; failed=$((failed + 1)); fi
done
echo "$failed of $n seeds failed"
exit $failed
