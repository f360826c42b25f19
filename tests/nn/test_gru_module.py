"""tandem.nn.GRU against torch.nn.GRU (which we did not write), with copied weights."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch

import tandem


def test_state_dict_and_init_match_torch():
    torch.manual_seed(3)
    ref = torch.nn.GRU(6, 8, num_layers=2, bidirectional=True)
    torch.manual_seed(3)
    ours = tandem.nn.GRU(6, 8, num_layers=2, bidirectional=True)
    assert list(ours.state_dict()) == list(ref.state_dict())
    for (name, a), b in zip(ref.state_dict().items(), ours.state_dict().values()):
        assert torch.equal(a, b), name  # same initialisation draws in the same order
    back = torch.nn.GRU(6, 8, num_layers=2, bidirectional=True)
    back.load_state_dict(ours.state_dict())
    assert str(ours) == str(ref)


BAD_INPUTS = {
    "wrong-input-size": (dict(), lambda: (torch.randn(4, 2, 6), None)),
    "wrong-h0-shape": (dict(), lambda: (torch.randn(4, 2, 5), torch.randn(1, 3, 7))),
    "4d-input": (dict(), lambda: (torch.randn(4, 2, 5, 1), None)),
    "unbatched-with-3d-h0": (dict(), lambda: (torch.randn(4, 5), torch.randn(1, 1, 7))),
    "batched-with-2d-h0": (dict(), lambda: (torch.randn(4, 2, 5), torch.randn(1, 7))),
    "input-dtype": (dict(), lambda: (torch.randn(4, 2, 5, dtype=torch.float64), None)),
    "input-device": (dict(), lambda: (torch.randn(4, 2, 5, device="meta"), None)),
    "h0-device": (dict(), lambda: (torch.randn(4, 2, 5), torch.randn(1, 2, 7, device="meta"))),
    "bi-h0-layers": (dict(bidirectional=True), lambda: (torch.randn(4, 2, 5), torch.randn(1, 2, 7))),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input_raises_like_torch(name: str):
    kwargs, make = BAD_INPUTS[name]
    ref, ours = torch.nn.GRU(5, 7, **kwargs), tandem.nn.GRU(5, 7, **kwargs)
    x, h0 = make()
    with pytest.raises(Exception) as expected:
        ref(x, h0)
    with pytest.raises(type(expected.value)) as got:
        ours(x, h0)
    assert str(got.value), "the error must say what was expected and what came"


def test_hidden_dtype_mismatch_is_a_clear_error():
    with pytest.raises(RuntimeError, match=r"hx of dtype torch.float32 .* got torch.float64"):
        tandem.nn.GRU(5, 7)(torch.randn(4, 2, 5), torch.randn(1, 2, 7, dtype=torch.float64))


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(input_size=0, hidden_size=4),
        dict(input_size=3, hidden_size=0),
        dict(input_size=3, hidden_size=-2),
        dict(input_size=3, hidden_size=4, num_layers=0),
        dict(input_size=3, hidden_size=4, dropout=1.5),
        dict(input_size=3.0, hidden_size=4),
    ],
    ids=["input0", "hidden0", "hidden-neg", "layers0", "dropout", "float-size"],
)
def test_bad_constructor_arguments_raise_like_torch(kwargs):
    with pytest.raises(Exception) as expected:
        torch.nn.GRU(**kwargs)
    with pytest.raises(type(expected.value), match=str(expected.value).split(".")[0][:30]):
        tandem.nn.GRU(**kwargs)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph_equals_eager(backend: str, tmp_path, monkeypatch):
    # a private compile cache: inductor's on-disk cache keys do not cover custom-op schemas
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch.compiler.reset()

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gru = tandem.nn.GRU(5, 8, num_layers=2, bidirectional=True, batch_first=True)
            self.head = torch.nn.Linear(16, 3)

        def forward(self, x):
            out, _ = self.gru(x)
            return self.head(out.mean(1))

    model = Model()
    x = torch.randn(4, 6, 5, requires_grad=True)
    eager = model(x)
    (eager_grad,) = torch.autograd.grad(eager.sum(), x)
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = compiled(x)
    (got_grad,) = torch.autograd.grad(got.sum(), x)
    torch.testing.assert_close(got, eager)
    torch.testing.assert_close(got_grad, eager_grad)
    # nothing of tandem's draws a warning from the compiler (it once warned of a cached function)
    ours = [str(w.message) for w in caught if is_tandems(w)]
    assert not ours, ours


_PACKAGE = Path(tandem.__file__).resolve().parent


def is_tandems(w: warnings.WarningMessage) -> bool:
    """A warning raised in tandem's package, or naming one of its modules or ops: not any whose path
    holds "tandem" (a clone in a folder of that name has its .venv, torch included, under it)."""
    try:
        inside = Path(w.filename).resolve().is_relative_to(_PACKAGE)
    except (OSError, ValueError):
        inside = False
    return (
        inside
        or str(_PACKAGE) in str(w.message)
        or re.search(r"\btandem(\.|::)\w", str(w.message)) is not None
    )


@pytest.mark.parametrize(
    "filename, message, expected",
    [
        (str(_PACKAGE / "nn" / "gru.py"), "something", True),
        ("/x/lib/python3.11/site-packages/torch/_dynamo/utils.py", "in tandem.ops.gru: a graph break", True),
        ("/x/lib/torch/_dynamo/utils.py", "tandem::gru_fwd has no fake kernel", True),
        ("/home/u/tandem/.venv/lib/python3.11/site-packages/torch/jit/_script.py", "script_method", False),
        ("/home/u/tandem/.venv/lib/torch/x.py", "see /home/u/tandem/.venv/lib/torch/x.py", False),
    ],
    ids=["in-package", "names-a-module", "names-an-op", "torch-in-a-clone-named-tandem", "path-in-message"],
)
def test_only_tandems_own_warnings_count_wherever_it_is_cloned(filename: str, message: str, expected: bool):
    w = warnings.WarningMessage(DeprecationWarning(message), DeprecationWarning, filename, 1)
    assert is_tandems(w) == expected
