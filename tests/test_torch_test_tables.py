"""tandem's drop-ins driven by PyTorch's own test tables, as PyTorch tests its modules and optimizers.

``torch.testing._internal.common_modules.module_db`` has, for torch.nn.GRU and LSTM, the inputs and
constructor arguments PyTorch tests them with (``module_inputs_func``) and the wrong ones with the error
each must raise (``module_error_inputs_func``); ``common_optimizers.optim_db`` has the same for
torch.optim.Adagrad. For every input and configuration they generate, tandem's class must give torch's
outputs, gradients (of inputs and parameters) and errors (same type, same message). The tables are
torch's API for testing, read here as data. They need ``expecttest`` (a dev extra) and may be absent or
different in other torch builds: then this file is skipped, with the reason.
"""

from __future__ import annotations

import inspect
import re
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.nn.utils.rnn import PackedSequence


def _tables() -> tuple[Any, Any]:
    try:
        from torch.testing._internal import common_modules, common_optimizers
    except Exception as e:  # missing (slim install, no expecttest) or failing to import in this torch
        pytest.skip(
            f"torch.testing._internal's test tables do not import here: {e!r}", allow_module_level=True
        )
    finally:
        # importing common_utils freezes torch.backends' flags (torch.backends.disable_global_flags, for
        # torch's own test runner); the rest of this suite sets some of them directly
        torch.backends.flags_frozen.__globals__["__allow_nonbracketed_mutation_flag"] = True
    return common_modules, common_optimizers


common_modules, common_optimizers = _tables()

import tandem  # noqa: E402  (after the skip: nothing of tandem is needed when the tables are absent)

DTYPES = {"f32": torch.float32, "f64": torch.float64}


def read(table: Callable[[], list]) -> list:
    """The cases a table gives; the file is skipped (not failed) where this torch's tables differ from
    what this file reads."""
    try:
        return table()
    except Exception as e:
        pytest.skip(
            f"this torch's test tables differ from what this file reads: {e!r}", allow_module_level=True
        )


def _module_infos() -> dict[str, Any]:
    infos = {info.module_cls.__name__: info for info in common_modules.module_db}
    missing = {"GRU", "LSTM"} - infos.keys()
    if missing:
        pytest.skip(f"module_db has no entry for {sorted(missing)} in this torch", allow_module_level=True)
    return {name: infos[name] for name in ("GRU", "LSTM")}


MODULE_INFOS = _module_infos()


def _describe(kwargs: dict[str, Any]) -> str:
    parts = [f"L{kwargs.get('num_layers', 1)}", "bi" if kwargs.get("bidirectional") else "uni"]
    parts += ["bf"] * bool(kwargs.get("batch_first")) + ["nobias"] * (kwargs.get("bias") is False)
    proj = kwargs.get("proj_size")
    return "-".join(parts + ([f"proj{proj}"] if proj else []))


def _forward_kind(sample: Any) -> str:
    args = sample.forward_input.args
    kind = "packed" if isinstance(args[0], PackedSequence) else f"{args[0].dim()}d"
    return kind + "-hx" * (len(args) > 1)


def _module_samples() -> list:
    """Every sample of the GRU and LSTM inputs functions, per dtype and mode (ids: readable, unique)."""
    params = []
    for name, info in MODULE_INFOS.items():
        takes_packed = "with_packed_sequence" in inspect.signature(info.module_inputs_func).parameters
        for dtype_id, dtype in DTYPES.items():
            for training in (True, False):
                extra = {"with_packed_sequence": True} if takes_packed else {}
                samples = info.module_inputs_func(
                    info, device="cpu", dtype=dtype, requires_grad=True, training=training, **extra
                )
                for i, sample in enumerate(samples):
                    desc = f"{_describe(sample.constructor_input.kwargs)}-{_forward_kind(sample)}"
                    mode = "train" if training else "eval"
                    params.append(
                        pytest.param(name, sample, training, id=f"{name}-{dtype_id}-{mode}-{i}-{desc}")
                    )
    return params


def _leaf(x: Any) -> Any:
    """A fresh leaf copy of a tensor argument (the data of a PackedSequence, the members of a tuple)."""
    if isinstance(x, PackedSequence):
        return x._replace(data=_leaf(x.data))
    if isinstance(x, tuple):
        return tuple(_leaf(t) for t in x)
    if isinstance(x, torch.Tensor):
        return x.detach().clone().requires_grad_(x.requires_grad)
    return x


def _tensors(x: Any) -> list[torch.Tensor]:
    """The tensors in an output or argument, in order."""
    if isinstance(x, PackedSequence):
        return [x.data]
    if isinstance(x, (tuple, list)):
        return [t for item in x for t in _tensors(item)]
    return [x] if isinstance(x, torch.Tensor) else []


def _run_module(module: torch.nn.Module, sample: Any) -> dict[str, torch.Tensor]:
    """Forward on fresh leaves, backward of a fixed random weighting of every output; the outputs and
    the gradients of every input and parameter."""
    args = [_leaf(a) for a in sample.forward_input.args]
    kwargs = {k: _leaf(v) for k, v in sample.forward_input.kwargs.items()}
    outputs = _tensors(module(*args, **kwargs))
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(t.shape, generator=gen, dtype=torch.float64).to(t.dtype) for t in outputs]
    torch.autograd.backward(outputs, weights)
    inputs = _tensors(args) + _tensors(list(kwargs.values()))
    named = {f"output {i}": t.detach() for i, t in enumerate(outputs)}
    named |= {f"grad input {i}": t.grad for i, t in enumerate(inputs)}
    return named | {f"grad {n}": p.grad for n, p in module.named_parameters()}


@pytest.mark.parametrize("name, sample, training", read(_module_samples))
def test_module_inputs_give_torchs_outputs_and_gradients(name: str, sample: Any, training: bool):
    info = MODULE_INFOS[name]
    ctor = sample.constructor_input
    dtype = _tensors(list(sample.forward_input.args))[0].dtype
    # as torch's tests build them: constructed, then moved to the inputs' dtype
    ref = info.module_cls(*ctor.args, **ctor.kwargs).to(dtype).train(training)
    ours = getattr(tandem.nn, name)(*ctor.args, **ctor.kwargs).to(dtype).train(training)
    ours.load_state_dict(ref.state_dict())
    want, got = _run_module(ref, sample), _run_module(ours, sample)
    assert got.keys() == want.keys()
    tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-10, rtol=1e-9)
    for key, value in want.items():
        assert (got[key] is None) == (value is None), key
        if value is not None:
            torch.testing.assert_close(got[key], value, **tol, msg=lambda m, k=key: f"{k}: {m}")


def _outcome(fn: Callable[[], Any]) -> tuple[str, str]:
    """``(exception type, message)`` of what ``fn`` raised, or of the first warning it gave, or
    ``("no error", "")``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            fn()
        except Exception as e:
            return type(e).__name__, str(e)
    relevant = [w for w in caught if not issubclass(w.category, DeprecationWarning)]
    return (relevant[0].category.__name__, str(relevant[0].message)) if relevant else ("no error", "")


def _module_error_samples() -> list:
    params = []
    for name, info in MODULE_INFOS.items():
        for dtype_id, dtype in DTYPES.items():
            samples = info.module_error_inputs_func(
                info, device="cpu", dtype=dtype, requires_grad=False, training=True
            )
            for i, sample in enumerate(samples):
                ctor = sample.module_error_input.constructor_input
                desc = "-".join([str(a) for a in ctor.args] + [f"{k}={v}" for k, v in ctor.kwargs.items()])
                desc = re.sub(r"[^\w.=-]+", "", desc.replace("torch.", ""))
                params.append(pytest.param(name, sample, id=f"{name}-{dtype_id}-{i}-{desc}"))
    return params


@pytest.mark.parametrize("name, error", read(_module_error_samples))
def test_module_error_inputs_raise_torchs_errors(name: str, error: Any):
    info = MODULE_INFOS[name]
    sample = error.module_error_input
    ctor = sample.constructor_input
    forward = error.error_on == common_modules.ModuleErrorEnum.FORWARD_ERROR

    def attempt(cls) -> Callable[[], Any]:
        def run() -> Any:
            module = cls(*ctor.args, **ctor.kwargs)
            if forward:
                module(*sample.forward_input.args, **sample.forward_input.kwargs)

        return run

    want = _outcome(attempt(info.module_cls))
    assert want[0] == error.error_type.__name__ and re.search(error.error_regex, want[1]), want  # the table
    assert _outcome(attempt(getattr(tandem.nn, name))) == want


# ---------------------------------------------------------------------------------------------------
# Adagrad


def _adagrad_info() -> Any:
    infos = [info for info in common_optimizers.optim_db if info.optim_cls is torch.optim.Adagrad]
    if not infos:
        pytest.skip("optim_db has no torch.optim.Adagrad entry in this torch", allow_module_level=True)
    return infos[0]


ADAGRAD = _adagrad_info()


def _optim_inputs(dtype: torch.dtype) -> list:
    func = ADAGRAD.optim_inputs_func
    kwargs = {"dtype": dtype} if "dtype" in inspect.signature(func).parameters else {}
    return func(device="cpu", **kwargs)


def _adagrad_samples() -> list:
    params = []
    impls = ["default"] + [i for i in getattr(ADAGRAD, "supported_impls", ()) if i in ("foreach", "fused")]
    for dtype_id, dtype in DTYPES.items():
        for i, sample in enumerate(_optim_inputs(dtype)):
            desc = re.sub(r"[^\w-]+", "-", sample.desc).strip("-")
            params += [
                pytest.param(sample, dtype, impl, id=f"{dtype_id}-{i}-{desc}-{impl}") for impl in impls
            ]
    return params


def _adagrad_params(dtype: torch.dtype) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(1)
    shapes = [(5, 4), (5,), ()]
    return [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=dtype)) for s in shapes]


def _adagrad_run(cls, sample: Any, dtype: torch.dtype, impl: str) -> dict[str, Any]:
    """Four steps (the last with one gradient missing) through a state_dict round trip; the parameters,
    the state, or what was raised."""
    params = _adagrad_params(dtype)
    kwargs = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in sample.kwargs.items()}
    if impl != "default":
        kwargs[impl] = True
    try:
        opt = cls(params, **kwargs)
        for step in range(4):
            gen = torch.Generator().manual_seed(10 + step)
            for k, p in enumerate(params):
                p.grad = None if (step == 3 and k == 1) else torch.randn(p.shape, generator=gen, dtype=dtype)
            opt.step()
            if step == 1:
                opt.load_state_dict(opt.state_dict())
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}
    state = opt.state_dict()["state"]
    result = {f"param {k}": p.detach() for k, p in enumerate(params)}
    result |= {f"sum {k}": s["sum"] for k, s in state.items()}
    return result | {f"step {k}": float(s["step"]) for k, s in state.items()}


@pytest.mark.parametrize("sample, dtype, impl", read(_adagrad_samples))
def test_adagrad_inputs_give_torchs_trajectory(sample: Any, dtype: torch.dtype, impl: str):
    want = _adagrad_run(torch.optim.Adagrad, sample, dtype, impl)
    got = _adagrad_run(tandem.optim.Adagrad, sample, dtype, impl)
    assert got.keys() == want.keys()
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-12, rtol=1e-11)
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(got[key], value, **tol, msg=lambda m, k=key: f"{k}: {m}")
        else:
            assert got[key] == value, key


def _adagrad_error_samples() -> list:
    params = []
    for dtype_id, dtype in DTYPES.items():
        for i, error in enumerate(ADAGRAD.optim_error_inputs_func(device="cpu", dtype=dtype)):
            desc = re.sub(r"[^\w-]+", "-", error.optimizer_error_input.desc).strip("-")
            params.append(pytest.param(error, id=f"{dtype_id}-{i}-{desc}"))
    return params


@pytest.mark.parametrize("error", read(_adagrad_error_samples))
def test_adagrad_error_inputs_raise_torchs_errors(error: Any):
    sample = error.optimizer_error_input
    step = error.error_on == common_optimizers.OptimizerErrorEnum.STEP_ERROR

    def attempt(cls) -> Callable[[], Any]:
        def run() -> Any:
            opt = cls(sample.params, **sample.kwargs)
            if step:
                opt.step()

        return run

    want = _outcome(attempt(torch.optim.Adagrad))
    assert want[0] == error.error_type.__name__ and re.search(error.error_regex, want[1]), want  # the table
    assert _outcome(attempt(tandem.optim.Adagrad)) == want
