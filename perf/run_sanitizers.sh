#!/usr/bin/env bash
# compute-sanitizer memcheck, racecheck and synccheck over perf/sanitize.py (GPU machine); its
# arguments (e.g. --only float32) go to sanitize.py.
# Host API errors are not reported: cuda-python probes driver entry points with
# cuGetProcAddress, which returns "invalid argument" for names the driver lacks.
OUT=${OUT:-sanitizer-out}; mkdir -p "$OUT"
for tool in memcheck racecheck synccheck; do
  timeout 170 compute-sanitizer --tool $tool --report-api-errors no --error-exitcode 1 python3 perf/sanitize.py "$@" > $OUT/$tool.log 2>&1
  echo "$tool rc=$? $(grep 'ERROR SUMMARY' $OUT/$tool.log) $(grep -c ' ok$' $OUT/$tool.log) cases ok"
done
