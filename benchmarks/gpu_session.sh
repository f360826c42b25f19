#!/usr/bin/env bash
# First command of a session with a lent GPU (its image has torch, triton and pytest; no network):
# the Triton kernels' tests on CUDA, then the GPU benchmarks, tables last. Run from the repository root:
#   bash benchmarks/gpu_session.sh [--quick]
# Writes CSVs, charts and logs under $OUT (the device tool brings that folder back), else /tmp.
set -uo pipefail
export PYTHONPATH=src
out=${OUT:-/tmp/tandem-gpu}
mkdir -p "$out"
python3 - <<'PY' | tee "$out/versions.txt"
import torch, triton
print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())
PY
# every Triton test in tests/ops runs on CUDA here (not in the interpreter)
python3 -m pytest -q -p no:cacheprovider tests/ops -k "triton_kernel_" >"$out/pytest.log" 2>&1
echo "pytest exit $?: $(tail -n 1 "$out/pytest.log")"
for op in gru lstm adagrad syncbn; do
    python3 -m tandem bench --op "$op" --device cuda "$@" --csv "$out/$op.csv" --plot "$out/$op.png" \
        >"$out/bench-$op.txt" 2>&1
    echo "bench $op exit $?"
done
cat "$out"/bench-*.txt
