#!/usr/bin/env bash
# First command of a session with a lent GPU (its image has torch, triton and pytest; no network):
# the Triton kernels' tests on CUDA, then the GPU benchmarks, tables last. Run from the repository root:
#   bash benchmarks/gpu_session.sh [--quick]
#   PARTS="gru lstm" bash benchmarks/gpu_session.sh --quick     # some parts only
# PARTS (default "tests gru lstm adagrad") picks what runs, in that order; a device call runs at most
# 10 minutes, so where all of it may not fit in one, run "tests" first and the benchmarks in later calls.
# Bench options (--quick, --min-time S) go to every benchmark.
# Writes CSVs, charts and logs under $OUT (the device tool brings that folder back), else /tmp.
set -uo pipefail
export PYTHONPATH=src
out=${OUT:-/tmp/tandem-gpu}
parts=${PARTS:-tests gru lstm adagrad}
mkdir -p "$out"
python3 - <<'PY' | tee "$out/versions.txt"
import torch, triton
print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())
PY
for part in $parts; do
    case $part in
    tests)
        # every Triton test in tests/ops runs on CUDA here (not in the interpreter)
        python3 -m pytest -q -p no:cacheprovider tests/ops -k "triton_kernel_" >"$out/pytest.log" 2>&1
        echo "pytest exit $?: $(tail -n 1 "$out/pytest.log")"
        ;;
    gru | lstm | adagrad)
        python3 -m tandem bench --op "$part" --device cuda "$@" --csv "$out/$part.csv" \
            --plot "$out/$part.png" >"$out/bench-$part.txt" 2>&1
        echo "bench $part exit $?"
        cat "$out/bench-$part.txt"
        ;;
    *)
        echo "unknown part $part (tests, gru, lstm, adagrad)" >&2
        ;;
    esac
done
