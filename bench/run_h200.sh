#!/bin/bash
set -o pipefail
# Device-run driver: install the peer's wheels, find a launch setting whose kernels run, benchmark.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH
export TRITON_CACHE_DIR=/tmp/tcache
[ -f .whl/tcache.tgz ] && tar -xzf .whl/tcache.tgz -C /tmp
chosen=""
for tuning in "$@"; do
  echo "== debug with $tuning"
  if GDN2_TRITON_TUNING="$tuning" CUDA_LAUNCH_BLOCKING=1 timeout 150 python3 bench/triton_debug.py 2>&1 | tail -8; then
    chosen="$tuning"; break
  fi
done
echo "== chosen: $chosen"
[ -z "$chosen" ] && exit 1
export GDN2_TRITON_TUNING="$chosen"
PYTHONUNBUFFERED=1 timeout ${BENCH_SECONDS:-400} python3 bench/triton_h200.py $BENCH_ARGS --json $OUT/results.json 2>&1 | tee $OUT/log
tar -czf $OUT/tcache.tgz -C /tmp tcache
