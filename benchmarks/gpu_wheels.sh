#!/usr/bin/env bash
# The test suite's packages that the lent GPU's image lacks (soundfile, jiwer, librosa, expecttest, onnx,
# onnxruntime and what they need: ~42 MB), as wheels for its Python 3.12, into .whl/ (git-ignored). Run
# here, where pip reaches PyPI; a device call carries them (carry: [".whl"]) and
# `PARTS=suite bash benchmarks/gpu_session.sh` installs them there before running the whole suite under
# the image's torch (2.11).
set -euo pipefail
cd "$(dirname "$0")/.."
platforms=()
for p in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
    platforms+=(--platform "${p}_x86_64")
done
# versions as in a fresh .venv here; the image has numpy, scipy, scikit-learn, numba, msgpack, lazy_loader
wheels=(soundfile==0.14.0 cffi pycparser jiwer==4.0.0 rapidfuzz librosa==0.11.0 audioread==3.1.0 decorator
    pooch==1.9.0 platformdirs soxr==1.1.0 expecttest
    onnx==1.23.2 onnx-ir==1.1.0 onnxscript==0.7.2 onnxruntime==1.32.0 ml_dtypes==0.6.0 protobuf==7.36.2 flatbuffers)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" --platform any -d .whl "${wheels[@]}"
ls .whl
