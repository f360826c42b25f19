"""torch.onnx.export of tandem.nn.GRU and LSTM, both exporters, against torch's layers with the same weights:
the same outcome (an ONNX model of the same nodes and outputs, or the same exception type)."""

from __future__ import annotations

import io
import warnings
from typing import Any

import pytest
import torch

import tandem

PAIRS = [
    pytest.param(torch.nn.GRU, tandem.nn.GRU, id="gru"),
    pytest.param(torch.nn.LSTM, tandem.nn.LSTM, id="lstm"),
]
EXPORTERS = [
    pytest.param(False, id="torchscript"),
    pytest.param(True, id="dynamo"),  # torch.export's, the default since torch 2.9
]
# (kwargs, with a state): one or two layers, one or two directions, batch_first
SETTINGS = {
    "uni-h0": (dict(), True),
    "bi-2layers-bf": (dict(num_layers=2, bidirectional=True, batch_first=True), False),
}


class _Tagger(torch.nn.Module):
    """A model with a recurrent layer inside, as an application exports it."""

    def __init__(self, rnn: torch.nn.RNNBase):
        super().__init__()
        directions = 2 if rnn.bidirectional else 1
        self.embed = torch.nn.Linear(4, rnn.input_size)
        self.rnn = rnn
        self.head = torch.nn.Linear(directions * (rnn.proj_size or rnn.hidden_size), 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(torch.tanh(self.embed(x)))[0]).log_softmax(-1)


def _flat(args: tuple[Any, ...]) -> list[torch.Tensor]:
    return [t for a in args for t in (a if isinstance(a, tuple) else (a,))]


def _export(model: torch.nn.Module, args: tuple[Any, ...], dynamo: bool) -> bytes | type[BaseException]:
    """The ONNX model's bytes, or the type of the exporter's exception."""
    f = io.BytesIO()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the TorchScript exporter is deprecated (torch 2.13)
            torch.onnx.export(model.eval(), args, f, dynamo=dynamo, verbose=False)
    except Exception as e:
        return type(e)
    return f.getvalue()


def _run(onnx_model: bytes, args: tuple[Any, ...]) -> list[torch.Tensor] | type[BaseException]:
    """The model's outputs under onnxruntime, or the type of its exception."""
    ort = pytest.importorskip("onnxruntime")
    try:
        session = ort.InferenceSession(onnx_model, providers=["CPUExecutionProvider"])
        feeds = {i.name: t.numpy() for i, t in zip(session.get_inputs(), _flat(args))}
        return [torch.from_numpy(o) for o in session.run(None, feeds)]
    except Exception as e:
        return type(e)


def _assert_exports_as_torchs(ref: torch.nn.Module, ours: torch.nn.Module, args: tuple, dynamo: bool):
    pytest.importorskip("onnxruntime")
    onnx = pytest.importorskip("onnx")
    if dynamo:
        pytest.importorskip("onnxscript")
    ours.load_state_dict(ref.state_dict())
    want, got = _export(ref, args, dynamo), _export(ours, args, dynamo)
    if not isinstance(want, bytes):
        assert got is want, f"torch's export raised {want.__name__}, tandem's gave {got}"
        return
    assert isinstance(got, bytes), f"torch's layer exports, tandem's raised {got.__name__}"
    nodes = [[n.op_type for n in onnx.load_from_string(m).graph.node] for m in (want, got)]
    assert nodes[1] == nodes[0]
    ran_want, ran_got = _run(want, args), _run(got, args)
    if not isinstance(ran_want, list):  # torch's model does not run (an LSTM with a projection)
        assert ran_got is ran_want
        return
    assert isinstance(ran_got, list), f"torch's exported model runs, tandem's raised {ran_got.__name__}"
    with torch.no_grad():
        eager = ref(*args)
    eager = [eager] if isinstance(eager, torch.Tensor) else _flat((eager[0], eager[1]))
    assert len(ran_got) == len(ran_want) == len(eager)
    for g, w, e in zip(ran_got, ran_want, eager):
        torch.testing.assert_close(g, w, rtol=0, atol=0)  # the same graph on the same runtime
        torch.testing.assert_close(g, e)


def _layers(torch_cls, tandem_cls, kwargs: dict) -> tuple[torch.nn.Module, torch.nn.Module, tuple]:
    ref, ours = torch_cls(4, 6, **kwargs), tandem_cls(4, 6, **kwargs)
    x = torch.randn(3, 5, 4) if kwargs.get("batch_first") else torch.randn(5, 3, 4)
    return ref, ours, x


@pytest.mark.parametrize("dynamo", EXPORTERS)
@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("torch_cls, tandem_cls", PAIRS)
def test_onnx_export_as_torchs(torch_cls, tandem_cls, setting: str, dynamo: bool):
    kwargs, with_state = SETTINGS[setting]
    ref, ours, x = _layers(torch_cls, tandem_cls, kwargs)
    args: tuple = (x,)
    if with_state:
        directions = 2 if kwargs.get("bidirectional") else 1
        h0 = torch.randn(directions * kwargs.get("num_layers", 1), 3, 6)
        args = (x, h0 if torch_cls is torch.nn.GRU else (h0, torch.randn_like(h0)))
    _assert_exports_as_torchs(ref, ours, args, dynamo)


@pytest.mark.parametrize("dynamo", EXPORTERS)
def test_onnx_export_of_an_lstm_with_a_projection_as_torchs(dynamo: bool):
    """TorchScript's exporter refuses a projection (its SymbolicValueError); torch.export's exports a model
    that onnxruntime refuses (torch 2.13): tandem's the same."""
    ref, ours, x = _layers(torch.nn.LSTM, tandem.nn.LSTM, dict(proj_size=3, bidirectional=True))
    _assert_exports_as_torchs(ref, ours, (x, (torch.randn(2, 3, 3), torch.randn(2, 3, 6))), dynamo)


@pytest.mark.parametrize("dynamo", EXPORTERS)
@pytest.mark.parametrize("torch_cls, tandem_cls", PAIRS)
def test_onnx_export_of_a_model_with_a_layer_inside_as_torchs(torch_cls, tandem_cls, dynamo: bool):
    ref, ours, x = _layers(torch_cls, tandem_cls, dict(bidirectional=True, batch_first=True))
    _assert_exports_as_torchs(_Tagger(ref), _Tagger(ours), (x,), dynamo)


@pytest.mark.parametrize("torch_cls, tandem_cls", PAIRS)
def test_torch_export_keeps_the_custom_ops(torch_cls, tandem_cls):
    """Outside an ONNX export (before it, and after one has failed) torch.export records tandem's op."""
    op = torch.ops.tandem.gru_fwd if tandem_cls is tandem.nn.GRU else torch.ops.tandem.lstm_fwd
    ours = tandem_cls(4, 6, bidirectional=True).eval()
    x = torch.randn(5, 3, 4)
    for _ in range(2):
        program = torch.export.export(ours, (x,))
        assert op.default in [n.target for n in program.graph.nodes]
        assert not torch.onnx.is_in_onnx_export()
        with pytest.raises(RuntimeError), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the TorchScript exporter is deprecated (torch 2.13)
            torch.onnx.export(ours, (torch.randn(5, 3, 5),), io.BytesIO(), dynamo=False)  # 5 features, not 4
