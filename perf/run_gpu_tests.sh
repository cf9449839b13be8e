#!/usr/bin/env bash
# The GPU tests in shards side by side on one GPU (GPU machine): pytest has no xdist there, and
# one process compiles its kernels one after another, so a file of ~300 tests takes longer than
# a device call. Shards run in parallel (their compiles on the CPU cores, their kernels on the
# one GPU); a shard cut by the timeout leaves its later tests unrun, listed for the next call.
#   perf/run_gpu_tests.sh NODE_IDS_FILE [SHARDS] [TIMEOUT_S]
# PYTHON: the interpreter (default python). NODE_IDS_FILE: one pytest node id per line (pytest -m gpu --collect-only -q ... | grep ::).
# SOLO: an extended regex of ids that take most of the GPU's memory (default: the 131072-token
# and 2^31-element tests: tens of GiB each); they run one at a time after the shards (within
# TIMEOUT_S of their own), since beside them the shards' tests failed to allocate (seventy-first
# session).
# Writes $OUT/gpu-tests.log (every test's PASSED / FAILED line) and $OUT/gpu-tests-unrun.txt.
set -u
ids=$1; shards=${2:-14}; limit=${3:-470}
OUT=${OUT:-gpu-tests-out}; mkdir -p "$OUT"
solo=${SOLO:-"test_sequence_of_131072|test_tensors_over_2_to_the_31_elements"}
grep -E "$solo" "$ids" > "$OUT/solo.txt"; grep -vE "$solo" "$ids" > "$OUT/shared.txt"
for i in $(seq 0 $((shards - 1))); do
  awk -v n="$shards" -v i="$i" 'NR % n == i' "$OUT/shared.txt" > "$OUT/shard_$i.txt"
  ( timeout "$limit" xargs -a "$OUT/shard_$i.txt" -d '\n' "${PYTHON:-python}" -m pytest -v -m gpu -p no:cacheprovider --no-header -rf \
      > "$OUT/shard_$i.log" 2>&1; echo "shard $i rc=$?" >> "$OUT/shard_$i.log" ) &
done
wait
if [ -s "$OUT/solo.txt" ]; then
  timeout "$limit" xargs -a "$OUT/solo.txt" -d '\n' "${PYTHON:-python}" -m pytest -v -m gpu -p no:cacheprovider --no-header \
      -rf > "$OUT/shard_solo.log" 2>&1; echo "shard solo rc=$?" >> "$OUT/shard_solo.log"
fi
rm -f "$OUT/solo.txt" "$OUT/shared.txt"
cat "$OUT"/shard_*.log > "$OUT/gpu-tests.log"; rm -f "$OUT"/shard_*
grep " PASSED" "$OUT/gpu-tests.log" | sed 's/ PASSED.*//' | sort > "$OUT/passed.txt"
grep -E " (FAILED|ERROR|SKIPPED)" "$OUT/gpu-tests.log" | sed -E 's/ (FAILED|ERROR|SKIPPED).*//' | sort > "$OUT/failed.txt"
sort "$ids" | comm -23 - "$OUT/passed.txt" | comm -23 - "$OUT/failed.txt" > "$OUT/gpu-tests-unrun.txt"
echo "passed $(wc -l < "$OUT/passed.txt") failed, errors or skipped $(wc -l < "$OUT/failed.txt") unrun $(wc -l < "$OUT/gpu-tests-unrun.txt") of $(wc -l < "$ids")"
cat "$OUT/failed.txt"; rm -f "$OUT/passed.txt" "$OUT/failed.txt"
grep -h "rc=" "$OUT/gpu-tests.log" | sed 's/.*rc=/rc=/' | sort | uniq -c
