"""Running a test file's Triton tests where Triton kernels can run: on a GPU, or on the CPU under
Triton's interpreter in a fresh process (the env vars must be set before tandem is imported)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tandem import _backend

__all__ = [
    "TRITON_DEVICE",
    "TRITON_VERSION",
    "LaunchCounter",
    "backward_launches",
    "compile_sm90",
    "assert_builds_once",
    "compiled_variants",
    "sm90_signature",
    "local_memory_bytes",
    "needs_triton",
    "needs_triton_compiler",
    "run_under_interpreter",
]

SRC = Path(__file__).resolve().parents[1] / "src"


def _triton_device() -> str | None:
    if not _backend.triton_available():
        return None
    if _backend.FORCE_TRITON:
        return "cpu"
    return "cuda" if torch.cuda.is_available() else None


TRITON_DEVICE = _triton_device()


def _triton_version() -> tuple[int, int]:
    if not _backend.triton_available():
        return (0, 0)
    from tandem.ops._triton_rnn import TRITON_VERSION

    return TRITON_VERSION


# (major, minor) of the installed Triton, (0, 0) without one: what a kernel table leaves out may depend on it
TRITON_VERSION = _triton_version()
needs_triton = pytest.mark.skipif(
    TRITON_DEVICE is None,
    reason="no GPU: runs in test_triton_kernels_under_interpreter's subprocess (TRITON_INTERPRET=1)",
)
# tests that count the kernels Triton compiled: the interpreter compiles none (its subprocess leaves them out)
needs_triton_compiler = pytest.mark.skipif(
    TRITON_DEVICE != "cuda", reason="counts compiled kernels: a GPU only (the interpreter compiles none)"
)


def run_under_interpreter(test_file: str, keyword: str = "triton_kernel_", timeout: float = 280) -> None:
    """Run ``test_file``'s tests matching ``keyword`` with TRITON_INTERPRET=1 TANDEM_FORCE_TRITON=1;
    fail unless they all ran and passed."""
    if not _backend.triton_available():
        pytest.skip("triton is not installed")
    if _backend.FORCE_TRITON:
        pytest.skip("already the interpreter run")
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the same tests run compiled on it")
    env = dict(os.environ, TRITON_INTERPRET="1", TANDEM_FORCE_TRITON="1")
    env["PYTHONPATH"] = os.pathsep.join(x for x in (str(SRC), env.get("PYTHONPATH")) if x)
    cmd = [sys.executable, "-m", "pytest", test_file, "-q", "-k", keyword, "-p", "no:cacheprovider"]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    tail = run.stdout[-6000:] + run.stderr[-3000:]
    assert run.returncode == 0, tail
    assert " passed" in run.stdout and "skipped" not in run.stdout, tail


def compile_sm90(fn, signature: dict[str, str], constexprs: dict, **options):
    """Compile the Triton kernel ``fn`` ahead of time for sm_90 (no GPU needed): what the GPU build
    looks like (``.asm["ptx"]``, ``.metadata.shared``), which the interpreter cannot show."""
    triton = pytest.importorskip("triton")
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as e:  # pragma: no cover - other Triton layouts
        pytest.skip(f"no ahead-of-time compiler API in this Triton: {e}")
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def sm90_signature(
    fn, constexprs: dict, dtype: str, pointers: dict[str, str] | None = None
) -> dict[str, str]:
    """The argument types :func:`compile_sm90` takes for ``fn``, by the kernels' naming (STYLE.md):
    ``constexprs`` as such, ``p_`` pointers to ``dtype`` (or to ``pointers[name]``), any other argument a
    32-bit integer."""
    pointers = pointers or {}
    return {
        arg: "constexpr"
        if arg in constexprs
        else (f"*{pointers.get(arg, dtype)}" if arg.startswith("p_") else "i32")
        for arg in fn.arg_names
    }


def local_memory_bytes(cubin: bytes, tmp_path: Path) -> int:
    """The per-thread stack (spilled registers, local arrays) of a compiled kernel, by the cuobjdump
    that ships with Triton."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        pytest.skip(f"no cuobjdump at {tool}")
    (tmp_path / "kernel.cubin").write_bytes(cubin)
    usage = subprocess.run([tool, "-res-usage", tmp_path / "kernel.cubin"], capture_output=True, text=True)
    stack = re.search(r"STACK:(\d+)", usage.stdout)
    assert stack, usage.stdout + usage.stderr
    return int(stack.group(1))


def compiled_variants(kernel) -> int:
    """How many builds of the Triton kernel ``kernel`` this process holds (all devices, all specialisations
    of its arguments); skips where the Triton in use keeps them elsewhere or compiles nothing (the
    interpreter)."""
    if TRITON_DEVICE != "cuda":
        pytest.skip("the interpreter compiles nothing")
    caches = getattr(kernel, "device_caches", None)
    if caches is None:
        pytest.skip("this Triton keeps its compiled kernels elsewhere (no JITFunction.device_caches)")
    return sum(len(entry[0]) for entry in caches.values())


def assert_builds_once(layer: torch.nn.Module, kernels: list, dtype: torch.dtype) -> None:
    """Training steps of ``layer`` on packed batches of other lengths (so other rows at every step, another
    batch and packed total) build none of ``kernels`` again after the first batch: Triton specialises
    integer arguments on being 1 or a multiple of 16 unless told not to, and each build took seconds on the
    GPU, stalling tandem train's first epochs. Skips under the interpreter, which builds nothing."""
    from torch.nn.utils.rnn import pack_padded_sequence

    compiled_variants(kernels[0])

    def step(lengths: list[int]) -> None:
        x = torch.randn(max(lengths), len(lengths), layer.input_size, device=TRITON_DEVICE, dtype=dtype)
        out, _ = layer(pack_padded_sequence(x, lengths, enforce_sorted=False))
        out.data.float().square().sum().backward()

    step([17, 16, 5, 1])  # builds each kernel once
    built = [compiled_variants(k) for k in kernels]
    for lengths in ([33, 32, 31, 30, 3], [16] * 16, [1], [48, 47, 2, 2, 1, 1, 1]):
        step(lengths)
    assert [compiled_variants(k) for k in kernels] == built


class LaunchCounter:
    """Counts the launches of a Triton kernel and forwards them (monkeypatched over the kernel)."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


def backward_launches(module, layer: torch.nn.Module, kernels: list[str], graphs: bool, monkeypatch) -> dict:
    """Launches of each of ``kernels`` (names in ``module``, a cell's Triton module) in one training step
    of ``layer`` on a packed batch: per-step loops, ``CUDA_GRAPHS`` set to ``graphs``, every other switch
    of ``module`` as it is."""
    from torch.nn.utils.rnn import pack_padded_sequence

    monkeypatch.setattr(module, "TIME_LOOP", "per-step")
    monkeypatch.setattr(module, "CUDA_GRAPHS", graphs)
    monkeypatch.setattr(module, "STEP_GRAPHS", module.StepGraphs())
    counters = {name: LaunchCounter(getattr(module, name)) for name in kernels}
    for name, counter in counters.items():
        monkeypatch.setattr(module, name, counter)
    x = torch.randn(5, 3, layer.input_size, device=TRITON_DEVICE)
    out, _ = layer(pack_padded_sequence(x, [5, 2, 4], enforce_sorted=False))
    out.data.square().sum().backward()
    return {name: counter.launches for name, counter in counters.items()}
