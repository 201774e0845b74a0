#!/usr/bin/env bash
# One GPU-machine run: install the brought wheels, run the cuda tests, then the given steps.
#   bash scripts/device-run.sh tests tune bench-load bench-decode
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/bench-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src
export NOSTALL_COMMIT=$(cat .commit 2>/dev/null || echo unknown)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
rc=0
for step in "$@"; do
  echo "=== $step $(date -u +%T)"
  case $step in
    tests) python3 -m pytest -q -m cuda -rA tests 2>&1 | tail -n 60 | tee "$OUT/cuda-tests.txt" || rc=1 ;;
    alltests) python3 -m pytest -q -x tests 2>&1 | tail -n 40 | tee "$OUT/all-tests.txt" || rc=1 ;;
    gen) python3 -c "from nostall.synthetic import make_checkpoint; print(make_checkpoint('bench-out/flux', device='cuda'))" || rc=1 ;;
    tune) python3 scripts/tune_load.py bench-out/flux 2>&1 | tee "$OUT/tune.txt" || rc=1 ;;
    diag-decode) python3 scripts/diag_decode.py 2>&1 | tee "$OUT/diag-decode.txt" || rc=1 ;;
    diag) python3 scripts/diag_h2d.py 2>&1 | tee "$OUT/diag.txt" || rc=1 ;;
    bench-load-warm) python3 -m nostall.cli bench load --folder bench-out/flux --scenario page-cache --scenario memory-cache --out "$OUT/load-warm.json" 2>&1 | tee "$OUT/bench-load-warm.txt" || rc=1 ;;
    bench-load) python3 -m nostall.cli bench load --drop-caches --folder bench-out/flux --out "$OUT/load.json" 2>&1 | tee "$OUT/bench-load.txt" || rc=1 ;;
    bench-decode-smoke) python3 -m nostall.cli bench decode --dtype bf16 --repeat 2 --part timed --work bench-out/decode --out "$OUT/decode-smoke.json" --figure "$OUT/decode-timeline-{dtype}.png" 2>&1 | tee "$OUT/bench-decode-smoke.txt" || rc=1 ;;
    bench-decode-bf16) python3 -m nostall.cli bench decode --dtype bf16 --part timed --part memory --work bench-out/decode --out "$OUT/decode-bf16.json" --figure "$OUT/decode-timeline-{dtype}.png" 2>&1 | tee "$OUT/bench-decode-bf16.txt" || rc=1
      python3 -m nostall.cli bench decode --dtype fp32 --part memory --out "$OUT/decode-fp32-memory.json" 2>&1 | tee "$OUT/bench-decode-fp32-memory.txt" || rc=1 ;;
    bench-decode-fp32) python3 -m nostall.cli bench decode --dtype fp32 --part timed --work bench-out/decode --out "$OUT/decode-fp32.json" --figure "$OUT/decode-timeline-{dtype}.png" 2>&1 | tee "$OUT/bench-decode-fp32.txt" || rc=1 ;;
    bench-decode-b2b) python3 -m nostall.cli bench decode --part back-to-back --work bench-out/decode --out "$OUT/decode-b2b.json" 2>&1 | tee "$OUT/bench-decode-b2b.txt" || rc=1 ;;
    bench-decode) python3 -m nostall.cli bench decode --work bench-out/decode --out "$OUT/decode.json" --figure "$OUT/decode-timeline-{dtype}.png" 2>&1 | tee "$OUT/bench-decode.txt" || rc=1 ;;
    *) echo "unknown step $step"; rc=1 ;;
  esac
done
exit $rc
