#!/bin/bash
# benchmarks/gpu.py part by part, each under its own time limit, from a source checkout on a
# GPU machine where mechwatch is not installed (the run of benchmarks/results/gpu.md).
#
#   WHEELS=.whl OUT=/tmp/gpu bash benchmarks/gpu_parts.sh [part:seconds ...]
#
# WHEELS (optional): a folder of wheels for what the machine lacks (pydantic, pydantic-core,
# annotated-types, typing-inspection, typing-extensions, APScheduler, tzlocal, slack-sdk for its
# Python), installed with --no-index into /tmp/site. OUT: where each part's table
# (gpu_<part>.md) and log (log_<part>.txt) go. Default parts, in order: the sync count, the
# training-step overhead, the linear-algebra ops, the QK monitors, the FP32 backward; about
# 8 minutes in all at these limits. A part that runs out of time keeps the rows it printed.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/mechwatch-gpu}
mkdir -p "$OUT"
if [ -n "${WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$WHEELS"/*.whl || exit 1
fi
# The rule packs install as the package `mechwatch_rules` (pyproject.toml); from source, a link.
mkdir -p /tmp/mechwatch-pkgs && ln -sfn "$PWD/rules" /tmp/mechwatch-pkgs/mechwatch_rules
export PYTHONPATH=/tmp/site:/tmp/mechwatch-pkgs:$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/smi.txt"
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(sync:75 step:150 linalg:60 qk:150 attention:45)
for spec in "${parts[@]}"; do
  part=${spec%%:*}
  limit=${spec##*:}
  echo "=== $part (limit $limit s) $(date +%T)"
  timeout "$limit" python3 benchmarks/gpu.py --parts "$part" --out "$OUT/gpu_$part.md" \
    > "$OUT/log_$part.txt" 2>&1
  echo "rc $? $(date +%T)"
  tail -30 "$OUT/log_$part.txt"
done
