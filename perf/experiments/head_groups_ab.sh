#!/bin/bash
# The packed backward grid's head groups (CUTE_FLASH_HEAD_GROUP: consecutive block numbers per head
# before the next head's; 1 << 30 = the head-major order shipped before), each in its own process
# and compile cache, timed beside our dense path and flash-attn-4 in that process
# (perf/experiments/varlen_timeline.py). GPU script; writes to $OUT.
set -u
for group in ${GROUPS_TO_TRY:-1073741824 16 64}; do
  echo "### CUTE_FLASH_HEAD_GROUP=$group"
  CUTE_FLASH_HEAD_GROUP=$group CUTE_FLASH_CACHE_DIR=/tmp/cfc-group-$group timeout 200 \
    python perf/experiments/varlen_timeline.py --batches ${BATCHES:-equal32x2048,equal8x8192,mixed} --steps 5 2>&1 \
    | grep -v -i "warn\|exe_args"
done
