#!/usr/bin/env bash
# First command of a session with a lent GPU (its image has torch, triton and pytest; no network):
# the Triton kernels' tests on CUDA, then the GPU benchmarks, tables last. Run from the repository root:
#   bash benchmarks/gpu_session.sh [--quick]
#   PARTS="gru lstm" bash benchmarks/gpu_session.sh --quick     # some parts only
# PARTS (default "tests train profile bench-train adagrad transcribe gru lstm") picks what runs, in that
# order; a device call runs at most 10 minutes, so each part is cut at CAP seconds (default 240) and the next
# one runs. "train" is tandem train's speech recognizer on the GPU (one process, EPOCHS epochs, default 4);
# "profile" is benchmarks/gpu_profile.py (a GRU and an LSTM training step, kernel by kernel); "bench-train"
# is `tandem bench --op train` (the whole job, tandem's parts against torch's). Not in the defaults:
# "sweep" (benchmarks/gpu_sweep_bwd.py --cell lstm: the LSTM's backward blocks, about a minute);
# "split" (benchmarks/gpu_sweep_bwd.py --split: the split backward step against the fused, both cells);
# "split-sizes" (the same two steps, no block sweep, at the job's H128, H256 and H1024: where the split
# step pays with and without CUDA graphs, BWD_SPLIT's default);
# "suite" (the whole test suite under the image's torch, 2.11, which CI never runs: 6 minutes with 14
# pytest processes; it needs the wheels of benchmarks/gpu_wheels.sh, carried as .whl, and CAP=400;
# SUITE="tests/asr tests/parallel" runs those paths only).
# Bench options (--quick, --min-time S) go to every benchmark.
# Writes the logs, one CSV of every benchmark, the GRU/LSTM charts and the run's metrics.json under $OUT
# (the device tool brings back at most 8 files from that folder), else /tmp/tandem-gpu.
set -uo pipefail
export PYTHONPATH=src
out=${OUT:-/tmp/tandem-gpu}
parts=${PARTS:-tests train profile bench-train adagrad transcribe gru lstm}
cap=${CAP:-240}
mkdir -p "$out"
python3 - <<'PY' | tee "$out/session.txt"
import torch, triton
print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())
PY
# session.txt: the versions, then the profile
for part in $parts; do
    case $part in
    tests)
        # every Triton test in tests/ops runs on CUDA here (not in the interpreter)
        # in 8 processes where pytest-xdist is there: compiling the kernels is most of the time
        xdist=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8")
        timeout "$cap" python3 -m pytest -q -p no:cacheprovider $xdist --timeout 120 tests/ops \
            -k "triton_kernel_" >"$out/pytest.log" 2>&1
        echo "pytest exit $?: $(tail -n 1 "$out/pytest.log")"
        grep -E "^(FAILED|ERROR)" "$out/pytest.log" | head -n 40
        ;;
    train)
        runs=$(mktemp -d)
        timeout "$cap" python3 -m tandem train --device cuda --nproc 1 --epochs "${EPOCHS:-4}" \
            --out "$runs/asr" >"$out/train.log" 2>&1
        echo "train exit $?"
        tr '\r' '\n' <"$out/train.log" | grep -aE "test WER|^done|error|Error" | tail -n 12
        cp "$runs/asr/metrics.json" "$out/" 2>/dev/null
        ;;
    profile)
        timeout "$cap" python3 benchmarks/gpu_profile.py 2>&1 | tee -a "$out/session.txt"
        ;;
    suite)
        # the suite's packages the image lacks, from the carried wheels, on the path of pytest and its children
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/tandem-site .whl/*.whl >/dev/null 2>&1 || echo "no wheels in .whl: run gpu_wheels.sh here"
        # one thread per test process: 14 processes of 16 threads each on 16 cores (with the ranks they
        # spawn) left a DDP group not started in 45 s and a CPU GRU test at 200 s (an H100, 2026-11-26).
        # SIGINT at the cap, so pytest still prints what failed; -v names every test that ran.
        OMP_NUM_THREADS=1 PYTHONPATH=/tmp/tandem-site:src timeout -s INT -k 20 "$cap" python3 -m pytest -v \
            -p no:cacheprovider -n 14 --timeout 300 ${SUITE:-tests} >"$out/suite.log" 2>&1
        echo "suite exit $?: $(tail -n 1 "$out/suite.log")"
        grep -oE "(PASSED|FAILED|ERROR|SKIPPED) tests/[^: ]*" "$out/suite.log" | sort | uniq -c
        grep -E "^(FAILED|ERROR)|spawn_ranks" "$out/suite.log" | cut -c1-200 | head -n 40
        ;;
    sweep)
        timeout "$cap" python3 benchmarks/gpu_sweep_bwd.py --cell lstm 2>&1 | tee -a "$out/session.txt"
        ;;
    split)
        timeout "$cap" python3 benchmarks/gpu_sweep_bwd.py --split 2>&1 | tee -a "$out/session.txt"
        ;;
    split-sizes)
        timeout "$cap" python3 benchmarks/gpu_sweep_bwd.py --split --no-product-sweep \
            --shape T100-B16-I128-H128 T100-B32-I256-H256 T200-B64-I1024-H1024 2>&1 | tee -a "$out/session.txt"
        ;;
    gru | lstm | adagrad | transcribe | bench-train)
        part=${part#bench-}
        plot=()
        [[ $part == gru || $part == lstm ]] && plot=(--plot "$out/$part.png")
        timeout "$cap" python3 -m tandem bench --op "$part" --device cuda "$@" --csv "$out/bench.csv" \
            "${plot[@]}" >"$out/bench-part.txt" 2>&1
        echo "bench $part exit $?"
        cat "$out/bench-part.txt" | tee -a "$out/bench.txt"
        rm -f "$out/bench-part.txt"
        ;;
    *)
        echo "unknown part $part (tests, train, profile, sweep, split, split-sizes, suite, bench-train, gru, lstm," \
            "adagrad, transcribe)" >&2
        ;;
    esac
done
