"""Behaviour tandem.nn.GRU and tandem.nn.LSTM share, checked once for both against torch."""

from __future__ import annotations

import io
from typing import Optional

import pytest
import torch
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence

import tandem

PAIRS = [
    pytest.param(torch.nn.GRU, tandem.nn.GRU, id="gru"),
    pytest.param(torch.nn.LSTM, tandem.nn.LSTM, id="lstm"),
]


def _states_sum(hidden: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The sum of h_n (GRU) or of h_n and c_n (LSTM)."""
    return sum(h.sum() for h in hidden) if isinstance(hidden, tuple) else hidden.sum()


@pytest.mark.parametrize("torch_cls, tandem_cls", PAIRS)
def test_dropout_between_layers_matches_torch_and_is_off_in_eval(torch_cls, tandem_cls):
    kwargs = dict(num_layers=3, dropout=0.4, bidirectional=True, dtype=torch.float64)
    ref, ours = torch_cls(5, 6, **kwargs), tandem_cls(5, 6, **kwargs)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(7, 3, 5, dtype=torch.float64)
    torch.manual_seed(11)
    expected, _ = ref(x)
    torch.manual_seed(11)
    got, _ = ours(x)
    torch.testing.assert_close(got, expected)  # same dropout masks: same draws on same-shaped outputs
    ours.eval()
    first, _ = ours(x)
    second, _ = ours(x)
    assert torch.equal(first, second)
    ref.eval()
    torch.testing.assert_close(first, ref(x)[0])


@pytest.mark.parametrize("torch_cls, tandem_cls", PAIRS)
def test_input_without_grad_skips_dx_and_keeps_parameter_grads(torch_cls, tandem_cls):
    """Layer 0 of a model gets features that need no gradient: dx is skipped, the rest is unchanged."""
    kwargs = dict(num_layers=2, bidirectional=True, dtype=torch.float64)
    ref, ours = torch_cls(5, 6, **kwargs), tandem_cls(5, 6, **kwargs)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(7, 3, 5, dtype=torch.float64)
    for module in (ref, ours):
        out, hidden = module(x)
        (out.square().sum() + _states_sum(hidden)).backward()
    for (name, a), b in zip(ref.named_parameters(), ours.parameters()):
        torch.testing.assert_close(b.grad, a.grad, msg=name)


@pytest.mark.parametrize("torch_cls, tandem_cls", PAIRS)
def test_cpu_layers_under_another_default_device_as_torchs(torch_cls, tandem_cls):
    """A CPU model run where another device is the default (``torch.set_default_device("cuda")``, or the
    ``torch.device`` context; "meta" stands in for a GPU here): torch's layers compute on their tensors'
    device; tandem's made a padded batch's step sizes on the default device and its op refused them."""
    kwargs = dict(num_layers=2, bidirectional=True, dtype=torch.float64)
    ref, ours = torch_cls(5, 6, **kwargs), tandem_cls(5, 6, **kwargs)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(7, 3, 5, dtype=torch.float64)
    results = []
    for module in (ref, ours):
        with torch.device("meta"):
            out, hidden = module(x)
            (out.square().sum() + _states_sum(hidden)).backward()
        results.append((out, hidden, [p.grad for p in module.parameters()]))
    torch.testing.assert_close(results[1], results[0])


@pytest.mark.parametrize("batch_first", [False, True], ids=["tm", "bf"])
@pytest.mark.parametrize("torch_cls, tandem_cls", PAIRS)
def test_empty_batch_matches_torch(torch_cls, tandem_cls, batch_first):
    """B = 0: empty outputs and states of torch's shapes, and zero (not missing) parameter gradients."""
    kwargs = dict(num_layers=2, bidirectional=True, batch_first=batch_first)
    ref, ours = torch_cls(5, 6, **kwargs), tandem_cls(5, 6, **kwargs)
    ours.load_state_dict(ref.state_dict())
    shape = (0, 7, 5) if batch_first else (7, 0, 5)
    results = []
    for module in (ref, ours):
        x = torch.randn(shape, requires_grad=True)
        out, hidden = module(x)
        (out.sum() + _states_sum(hidden)).backward()
        states = hidden if isinstance(hidden, tuple) else (hidden,)
        results.append((out, states, x.grad, [p.grad for p in module.parameters()]))
    (out_ref, states_ref, dx_ref, grads_ref), (out, states, dx, grads) = results
    assert out.shape == out_ref.shape and dx.shape == dx_ref.shape
    assert [s.shape for s in states] == [s.shape for s in states_ref]
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, g_ref)  # zeros of the parameter's shape in both


@pytest.mark.parametrize("unbatched", [False, True], ids=["batched", "unbatched"])
@pytest.mark.parametrize("torch_cls, tandem_cls", PAIRS)
def test_no_time_steps_is_torchs_error(torch_cls, tandem_cls, unbatched):
    x = torch.randn(0, 5) if unbatched else torch.randn(0, 3, 5)
    with pytest.raises(RuntimeError) as expected:
        torch_cls(5, 6)(x)
    with pytest.raises(RuntimeError, match="sequence length") as got:
        tandem_cls(5, 6)(x)
    assert str(got.value) == str(expected.value)


# Every way of calling the constructors that torch takes or refuses: positional and keyword, wrong types
# and values, unknown keywords. tandem's modules must build the same module or raise the same error.
CONSTRUCTOR_CALLS = {
    "proj_size-kw": ((30, 20, 2), dict(proj_size=10)),
    "proj_size-negative": ((3, 4), dict(proj_size=-1)),
    "proj_size-too-big": ((3, 4), dict(proj_size=4)),
    "proj_size-float": ((3, 4), dict(proj_size=2.0)),
    "proj_size-zero": ((3, 4), dict(proj_size=0)),
    "all-positional": ((3, 4, 2, False, True, 0.5, True), {}),
    "eighth-positional": ((3, 4, 1, True, False, 0.0, False, "cpu"), {}),
    "unknown-keyword": ((3, 4), dict(foo=1)),
    "nonlinearity": ((3, 4), dict(nonlinearity="relu")),
    "no-arguments": ((), {}),
    "duplicate-argument": ((3, 4, 1), dict(num_layers=2)),
    "dropout-out-of-range": ((3, 4, 2), dict(dropout=1.5)),
    "dropout-bool": ((3, 4, 2), dict(dropout=True)),
    "dropout-str": ((3, 4, 2), dict(dropout="0.1")),
    "num_layers-float": ((3, 4, 2.0), {}),
    "num_layers-zero": ((3, 4, 0), {}),
    "bias-int": ((3, 4), dict(bias=1)),
    "batch_first-str": ((3, 4), dict(batch_first="False")),
    "input_size-str": (("3", 4), {}),
    "hidden_size-zero": ((3, 0), {}),
    "dtype-int": ((3, 4), dict(dtype=torch.int64)),
    "device-meta": ((3, 4), dict(device="meta")),
}


def _build(cls, args, kwargs):
    try:
        return cls(*args, **kwargs)
    except Exception as e:
        return e


@pytest.mark.parametrize("call", list(CONSTRUCTOR_CALLS))
@pytest.mark.parametrize("torch_cls, tandem_cls", PAIRS)
def test_constructor_takes_and_refuses_what_torch_does(torch_cls, tandem_cls, call: str):
    args, kwargs = CONSTRUCTOR_CALLS[call]
    torch.manual_seed(0)
    expected = _build(torch_cls, args, kwargs)
    torch.manual_seed(0)
    got = _build(tandem_cls, args, kwargs)
    if isinstance(expected, Exception):
        assert type(got) is type(expected), f"torch raised {expected!r}, tandem gave {got!r}"
        assert str(got) == str(expected)
        return
    assert not isinstance(got, Exception), f"torch built the module, tandem raised {got!r}"
    assert str(got) == str(expected)
    state, ref_state = got.state_dict(), expected.state_dict()
    assert list(state) == list(ref_state)
    for name, value in ref_state.items():
        assert state[name].shape == value.shape and state[name].device == value.device, name
        if value.device.type != "meta":
            assert torch.equal(state[name], value), name


@pytest.mark.parametrize("torch_cls, tandem_cls", PAIRS)
def test_forward_of_a_non_bool_bidirectional_is_torchs_error(torch_cls, tandem_cls):
    """torch's constructor takes bidirectional=1 (and builds both directions); its forward then raises."""
    x = torch.randn(3, 2, 4)
    with pytest.raises(TypeError) as expected:
        torch_cls(4, 5, bidirectional=1)(x)
    with pytest.raises(TypeError) as got:
        tandem_cls(4, 5, bidirectional=1)(x)
    assert str(got.value) == str(expected.value)


@pytest.mark.parametrize("torch_cls, tandem_cls", PAIRS)
def test_inference_mode_then_no_grad_then_training_match_torch(torch_cls, tandem_cls):
    """The CPU kernels' reused workspace was once created under torch.inference_mode: an inference
    tensor, which no later call outside it could write ('Inplace update to inference tensor outside
    InferenceMode'), so a model served with inference_mode could not be evaluated or trained after."""
    from tandem.ops import _workspace

    _workspace.release()  # the first call below makes the workspace
    ref, ours = (
        torch_cls(5, 6, num_layers=2, bidirectional=True),
        tandem_cls(5, 6, num_layers=2, bidirectional=True),
    )
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(7, 3, 5)
    packed = torch.nn.utils.rnn.pack_padded_sequence(x, torch.tensor([7, 5, 2]))
    for context in (torch.inference_mode, torch.no_grad, torch.enable_grad, torch.inference_mode):
        with context():
            got, expected = ours(packed)[0].data, ref(packed)[0].data
        torch.testing.assert_close(got, expected)
        if got.requires_grad:
            got.square().sum().backward()
            expected.square().sum().backward()
            for (name, a), b in zip(ref.named_parameters(), ours.parameters()):
                torch.testing.assert_close(b.grad, a.grad, msg=name)


def _pair(torch_cls, tandem_cls, dtype: torch.dtype, **kwargs):
    ref = torch_cls(3, 4, num_layers=2, bidirectional=True, dtype=dtype, **kwargs)
    ours = tandem_cls(3, 4, num_layers=2, bidirectional=True, dtype=dtype, **kwargs)
    ours.load_state_dict(ref.state_dict())
    return ref, ours


@pytest.mark.parametrize("torch_cls, tandem_cls", PAIRS)
def test_complex_numbers_match_torch(torch_cls, tandem_cls):
    """torch's layers take complex numbers on the CPU; so do tandem's, with the same gradients (the
    kernels' hand-written backward is for real numbers: the layers run torch's formulas there)."""
    torch.manual_seed(0)
    ref, ours = _pair(torch_cls, tandem_cls, torch.complex128)
    x = torch.randn(5, 2, 3, dtype=torch.complex128)
    grads = []
    for module in (ref, ours):
        xx = x.clone().requires_grad_()
        out, hidden = module(xx)
        (out.abs().square().sum() + _states_sum(hidden).abs()).backward()
        grads.append([out, xx.grad] + [p.grad for p in module.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a)


@pytest.mark.parametrize(
    "torch_cls, tandem_cls, state",
    [
        pytest.param(torch.nn.GRU, tandem.nn.GRU, 0, id="gru-h0"),
        pytest.param(torch.nn.LSTM, tandem.nn.LSTM, 0, id="lstm-h0"),
        pytest.param(torch.nn.LSTM, tandem.nn.LSTM, 1, id="lstm-c0"),
    ],
)
def test_an_infinite_initial_state_gives_torchs_infs_and_nans(torch_cls, tandem_cls, state):
    """An infinite entry of h0 (or c0) flows on as inf where torch's does and turns into NaN where
    torch's does, in the outputs and in every gradient. (The GRU's state update was a lerp, which
    computes h_prev - (h_prev - n) (1 - z) for z >= 0.5: NaN for an infinite h_prev, where torch's
    (h_prev - n) z + n is inf.)"""
    torch.manual_seed(0)
    ref, ours = _pair(torch_cls, tandem_cls, torch.float32)
    x = torch.randn(3, 4, 3)
    hidden = [torch.randn(4, 4, 4) for _ in range(2 if torch_cls is torch.nn.LSTM else 1)]
    inf = float("inf")
    hidden[state][2:, 0, :2] = torch.tensor([inf, -inf])  # the top layer's, of one sequence
    results = []
    for module in (ref, ours):
        xx = x.clone().requires_grad_()
        hx = [h.clone().requires_grad_() for h in hidden]
        out, h_n = module(xx, tuple(hx) if len(hx) == 2 else hx[0])
        (out.sum() + _states_sum(h_n)).backward()
        results.append([out, *(h_n if isinstance(h_n, tuple) else (h_n,)), xx.grad, *(h.grad for h in hx)])
        results[-1] += [p.grad for p in module.parameters()]
    assert any((~t.isfinite()).any() for t in results[0]) and results[0][0].isfinite().any(), "tests nothing"
    for a, b in zip(*results):
        torch.testing.assert_close(b, a, equal_nan=True)


@pytest.mark.parametrize("torch_cls, tandem_cls", PAIRS)
def test_forward_mode_ad_and_torch_func_match_torch(torch_cls, tandem_cls):
    """torch.func.jvp (once zeros, without a word), torch.autograd.forward_ad, torch.func.grad over
    functional_call (once torch.func's error about setup_context): torch's numbers."""
    torch.manual_seed(0)
    ref, ours = _pair(torch_cls, tandem_cls, torch.float64)
    x = torch.randn(5, 2, 3, dtype=torch.float64)
    tangent = torch.randn_like(x)

    def jvp(module):
        return torch.func.jvp(lambda xx: module(xx)[0], (x,), (tangent,))[1]

    def dual(module):
        with torch.autograd.forward_ad.dual_level():
            out = module(torch.autograd.forward_ad.make_dual(x, tangent))[0]
            return torch.autograd.forward_ad.unpack_dual(out).tangent

    def grad(module):
        loss = lambda p: torch.func.functional_call(module, p, (x,))[0].square().sum()
        return torch.func.grad(loss)(dict(module.named_parameters()))

    expected = jvp(ref)
    assert expected.abs().max() > 0.01  # not zeros
    torch.testing.assert_close(jvp(ours), expected)
    torch.testing.assert_close(dual(ours), dual(ref))
    theirs, got = grad(ref), grad(ours)
    assert list(got) == list(theirs)
    for name in theirs:
        torch.testing.assert_close(got[name], theirs[name], msg=name)
    # compiled (torch.compile's default graph breaks, not fullgraph: torch's own layers break there too):
    # tandem's kernels raised torch.func's error about setup_context
    torch.compiler.reset()
    compiled = torch.compile(torch.func.grad(lambda xx: ours(xx)[0].sin().sum()), backend="aot_eager")
    torch.testing.assert_close(compiled(x), torch.func.grad(lambda xx: ref(xx)[0].sin().sum())(x))
    # over functional_call, whose parametrization context admits no graph break: the padded batch's step
    # sizes were read from a tensor (`.tolist()`, a break), and dynamo failed in the layer's first product
    torch.compiler.reset()
    grads = torch.func.grad(_sin_of_call, argnums=(0, 1))
    got = torch.compile(grads, backend="eager")(dict(ours.named_parameters()), x, ours)
    theirs = grads(dict(ref.named_parameters()), x, ref)
    assert list(got[0]) == list(theirs[0])
    torch.testing.assert_close(got, theirs)
    # tensors of its own (detached), compiled by AOTAutograd: the layer stored functorch's wrappers in its
    # weight cache while traced, and the compile failed ("Cannot access storage of TensorWrapper")
    torch.compiler.reset()
    got = torch.compile(grads, backend="aot_eager")(_detached(ours), x, ours)
    torch.testing.assert_close(got, grads(_detached(ref), x, ref))


def _detached(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in module.named_parameters()}


def _sin_of_call(params: dict[str, torch.Tensor], x: torch.Tensor, module: torch.nn.Module) -> torch.Tensor:
    return torch.func.functional_call(module, params, (x,))[0].sin().sum()


@pytest.mark.parametrize("bidirectional", [False, True], ids=["uni", "bi"])
@pytest.mark.parametrize("torch_cls, tandem_cls", PAIRS)
def test_output_changed_in_place_before_backward_as_torch(torch_cls, tandem_cls, bidirectional):
    """torch's layers do not save their output for backward, so callers change it in place (``y += x``,
    ``relu_``); tandem's once raised autograd's error about a modified saved tensor."""
    kwargs = dict(num_layers=2, bidirectional=bidirectional, dtype=torch.float64)
    ref, ours = torch_cls(3, 4, **kwargs), tandem_cls(3, 4, **kwargs)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(5, 2, 3, dtype=torch.float64)
    grads = []
    for module in (ref, ours):
        xx = x.clone().requires_grad_()
        out, _ = module(xx)
        out.mul_(2.0).relu_()
        out.square().sum().backward()
        grads.append([xx.grad] + [p.grad for p in module.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a)


@pytest.mark.parametrize("dropout", [2.0, -0.5, 1.0000001])
@pytest.mark.parametrize("torch_cls, tandem_cls", PAIRS)
def test_dropout_set_out_of_range_after_construction_is_torchs_error(torch_cls, tandem_cls, dropout):
    """torch's constructor checks dropout; its rnn op checks it again where it applies (training, between
    layers), with a RuntimeError; in eval or with one layer it is not used and nothing is said."""
    for layers, training in ((2, True), (2, False), (1, True)):
        outcomes = []
        for cls in (torch_cls, tandem_cls):
            module = cls(3, 4, num_layers=layers).train(training)
            module.dropout = dropout
            try:
                module(torch.randn(5, 2, 3))
                outcomes.append(None)
            except Exception as e:
                outcomes.append((type(e), str(e)))
        assert outcomes[1] == outcomes[0], (layers, training)


class _Counted(torch.nn.Module):
    """A parametrization that counts its calls and moves its state at each (as spectral_norm's power
    iteration does in training): the number of calls a forward makes shows in the numbers."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.float64))

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return w * (1 + 0.1 * self.calls)


@pytest.mark.parametrize("torch_cls, tandem_cls", PAIRS)
def test_parametrized_weights_are_evaluated_as_often_as_in_torch(torch_cls, tandem_cls):
    from torch.nn.utils import parametrize
    from torch.nn.utils.parametrizations import spectral_norm

    kwargs = dict(num_layers=2, bidirectional=True, dtype=torch.float64)
    ref, ours = torch_cls(5, 6, **kwargs), tandem_cls(5, 6, **kwargs)
    ours.load_state_dict(ref.state_dict())
    for module in (ref, ours):
        parametrize.register_parametrization(module, "weight_hh_l0", _Counted())
        torch.manual_seed(4)  # spectral_norm's first vectors
        spectral_norm(module, "weight_ih_l1_reverse")
    x = torch.randn(7, 3, 5, dtype=torch.float64)
    for _ in range(3):
        expected, got = ref(x)[0], ours(x)[0]
        torch.testing.assert_close(got, expected)
    state = lambda m: {k: v for k, v in m.state_dict().items() if "parametrizations" in k}  # noqa: E731
    for (name, a), b in zip(state(ref).items(), state(ours).values()):
        torch.testing.assert_close(b, a, msg=name)  # the counter, spectral_norm's u and v


@pytest.mark.parametrize("torch_cls, tandem_cls", PAIRS)
def test_functional_call_with_parameters_of_another_dtype_as_torch(torch_cls, tandem_cls):
    ref, ours = torch_cls(5, 6, bidirectional=True), tandem_cls(5, 6, bidirectional=True)
    ours.load_state_dict(ref.state_dict())
    params = {k: v.double() for k, v in ref.named_parameters()}
    x = torch.randn(7, 3, 5, dtype=torch.float64)
    expected = torch.func.functional_call(ref, params, (x,))[0]
    got = torch.func.functional_call(ours, params, (x,))[0]
    assert got.dtype == expected.dtype == torch.float64
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(ours(x.float())[0], ref(x.float())[0])  # its own parameters again


@pytest.mark.parametrize("torch_cls, tandem_cls", PAIRS)
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
@pytest.mark.parametrize("base, other", [(torch.float32, torch.bfloat16), (torch.float64, torch.float32)])
@pytest.mark.parametrize("name", ["weight_hh_l0", "bias_ih_l0", "weight_ih_l1_reverse", "bias_hh_l1"])
def test_one_weight_of_another_dtype_is_refused_where_torchs_refuses(
    torch_cls, tandem_cls, packed, base, other, name
):
    """One weight replaced by a tensor of another dtype (a float64 numpy array, a bfloat16 checkpoint
    tensor): torch's products refuse the mix with a RuntimeError (its oneDNN LSTM, for dense float32,
    takes a bfloat16 bias); tandem's kernels computed in the input's dtype without a word."""
    from torch.nn.utils.rnn import pack_padded_sequence

    ref = torch_cls(3, 4, num_layers=2, bidirectional=True, dtype=base)
    ours = tandem_cls(3, 4, num_layers=2, bidirectional=True, dtype=base)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(5, 3, 3, dtype=base)
    outcomes = []
    for module in (ref, ours):
        setattr(module, name, torch.nn.Parameter(getattr(module, name).detach().to(other)))
        try:
            out, _ = module(pack_padded_sequence(x, [5, 4, 2]) if packed else x)
            out = out.data if packed else out
            out.sum().backward()
            outcomes.append((out, getattr(module, name).grad))
        except RuntimeError:
            outcomes.append(RuntimeError)
    if outcomes[0] is RuntimeError:
        assert outcomes[1] is RuntimeError
    else:
        assert outcomes[1] is not RuntimeError
        for expected, got in zip(*outcomes):
            torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("torch_cls, tandem_cls", PAIRS)
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize(
    "param_dtype, input_dtype",
    [(torch.float32, torch.float32), (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)],
)
def test_cpu_autocast_gives_torchs_numbers(torch_cls, tandem_cls, packed, param_dtype, input_dtype):
    """Under CPU autocast torch's CPU layers compute their products in bfloat16 and take mixed dtypes:
    the same numbers and dtypes, bit for bit."""
    kwargs = dict(num_layers=2, bidirectional=True, dtype=param_dtype)
    if torch_cls is torch.nn.LSTM:
        kwargs["proj_size"] = 4 if packed else 0
    ref, ours = torch_cls(5, 6, **kwargs), tandem_cls(5, 6, **kwargs)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(7, 3, 5).to(input_dtype)
    inp = torch.nn.utils.rnn.pack_padded_sequence(x, [7, 5, 2]) if packed else x
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected, got = ref(inp)[0], ours(inp)[0]
    if packed:
        expected, got = expected.data, got.data
    assert got.dtype == expected.dtype
    assert torch.equal(got, expected)


SETTINGS_CHANGED = {
    "fewer-layers": (dict(num_layers=2), dict(num_layers=1)),
    "more-layers": (dict(num_layers=2), dict(num_layers=3)),
    "bias-dropped": (dict(), dict(bias=False)),
    "bias-added": (dict(bias=False), dict(bias=True)),
    "one-direction": (dict(bidirectional=True), dict(bidirectional=False)),
    "two-directions": (dict(), dict(bidirectional=True)),
    "hidden-size": (dict(), dict(hidden_size=8)),
}


@pytest.mark.parametrize("torch_cls, tandem_cls", PAIRS)
@pytest.mark.parametrize("name", list(SETTINGS_CHANGED))
def test_settings_changed_after_construction_are_a_runtime_error(torch_cls, tandem_cls, name):
    """Settings that no longer describe the weights: torch's GRU raises a RuntimeError (its LSTM raises
    or computes with the weights it finds); tandem's layers raise one, naming the weight, for both."""
    made, changed = SETTINGS_CHANGED[name]
    ref, ours = torch_cls(4, 6, **made), tandem_cls(4, 6, **made)
    x = torch.randn(5, 3, 4)
    for module in (ref, ours):
        for key, value in changed.items():
            setattr(module, key, value)
    if torch_cls is torch.nn.GRU:
        with pytest.raises(RuntimeError):
            ref(x)
    with pytest.raises(RuntimeError, match=r"settings \(.*\) do not describe its weights: \w+ should"):
        ours(x)


@pytest.mark.parametrize("torch_cls, tandem_cls", PAIRS)
@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("traced_without_grad", [False, True], ids=["traced", "traced-no-grad"])
def test_torch_jit_trace_with_its_check_as_torch(
    torch_cls, tandem_cls, bidirectional, training, dtype, traced_without_grad
):
    """torch.jit.trace's default check re-runs the module without grad and compares the graphs: what a
    trace records must not depend on the grad mode. The traced module computes and trains as torch's,
    a trace made under torch.no_grad too. (float64 takes tandem's own op on the CPU, as float32 does on a
    GPU; float32 here goes through oneDNN's LSTM.)"""
    import contextlib
    import warnings

    ref = torch_cls(4, 6, bidirectional=bidirectional, dtype=dtype)
    ours = tandem_cls(4, 6, bidirectional=bidirectional, dtype=dtype)
    ours.load_state_dict(ref.state_dict())
    ref.train(training), ours.train(training)
    x = torch.randn(5, 3, 4, dtype=dtype)
    with warnings.catch_warnings(), torch.no_grad() if traced_without_grad else contextlib.nullcontext():
        warnings.simplefilter("ignore")  # torch.jit.trace is deprecated (torch 2.13)
        traced_ref, traced = torch.jit.trace(ref, (x,)), torch.jit.trace(ours, (x,))
    y = torch.randn(7, 3, 4, dtype=dtype)  # another length than the trace's
    expected, got = traced_ref(y)[0], traced(y)[0]
    torch.testing.assert_close(got, expected)
    expected.square().sum().backward()
    got.square().sum().backward()
    for (name, a), b in zip(ref.named_parameters(), ours.parameters()):
        torch.testing.assert_close(b.grad, a.grad, msg=name)


class _PackAndPad(torch.nn.Module):
    """What a model does around its recurrent layer: pack, run, pad back."""

    def __init__(self, rnn: torch.nn.Module) -> None:
        super().__init__()
        self.rnn = rnn

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

        out, _ = self.rnn(pack_padded_sequence(x, lengths, enforce_sorted=False))
        return pad_packed_sequence(out)[0]


@pytest.mark.parametrize("torch_cls, tandem_cls", PAIRS)
def test_a_trace_around_packing_takes_another_batch_as_torchs(torch_cls, tandem_cls):
    """torch.jit.trace of pack -> layer (no hx) -> pad, traced on 3 sequences, run on 2 and on 4: the
    zero states' batch is batch_sizes[0] as a tensor in the trace, as in torch's forward (tandem's int
    made it a constant, and the traced model refused another batch)."""
    import warnings

    ref, ours = torch_cls(3, 4, dtype=torch.float64), tandem_cls(3, 4, dtype=torch.float64)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(5, 3, 3, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit.trace is deprecated (torch 2.13), and its warnings
        traced = [torch.jit.trace(_PackAndPad(m), (x, torch.tensor([5, 2, 4])), check_trace=False)
                  for m in (ref, ours)]  # fmt: skip
    for steps, lengths in ((6, [2, 6]), (4, [4, 1, 3, 4])):
        y = torch.randn(steps, len(lengths), 3, dtype=torch.float64)
        expected, got = (t(y, torch.tensor(lengths)) for t in traced)
        torch.testing.assert_close(got, expected)


@pytest.mark.parametrize(
    "torch_cls, tandem_cls, kwargs",
    [
        pytest.param(torch.nn.GRU, tandem.nn.GRU, {}, id="gru"),
        pytest.param(torch.nn.LSTM, tandem.nn.LSTM, {}, id="lstm"),
        pytest.param(torch.nn.LSTM, tandem.nn.LSTM, {"proj_size": 3}, id="lstm-proj"),
    ],
)
def test_torch_jit_script_of_a_model_computes_and_trains_as_torchs(torch_cls, tandem_cls, kwargs):
    """torch.jit.script compiles torch's forward in the layers' place (TorchScript cannot compile
    tandem's kernels): the scripted model's outputs and gradients are torch's, its parameters the
    module's own, and the model's original holds the same state under torch's class."""
    import warnings

    class Model(torch.nn.Module):
        def __init__(self, rnn: torch.nn.Module) -> None:
            super().__init__()
            self.rnn, self.out = rnn, torch.nn.Linear(2 * (kwargs.get("proj_size") or 6), 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(self.rnn(x)[0])

    settings = dict(num_layers=2, bidirectional=True, dtype=torch.float64, **kwargs)
    ref, ours = Model(torch_cls(4, 6, **settings)), Model(tandem_cls(4, 6, **settings))
    ours.load_state_dict(ref.state_dict())
    rnn = ours.rnn
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit.script is deprecated (torch 2.13)
        scripted_ref, scripted = torch.jit.script(ref.double()), torch.jit.script(ours.double())
    x = torch.randn(5, 3, 4, dtype=torch.float64)
    expected, got = scripted_ref(x), scripted(x)
    assert torch.equal(got, expected)
    expected.square().sum().backward()
    got.square().sum().backward()
    for (name, a), b in zip(ref.named_parameters(), ours.parameters()):
        assert torch.equal(b.grad, a.grad), name
    assert rnn.weight_hh_l0.grad is ours.rnn.weight_hh_l0.grad is not None  # one module's parameters
    assert type(ours.rnn) is torch_cls and ours.rnn.__dict__ is rnn.__dict__
    rnn.train(False)
    assert not ours.rnn.training


def _first_gate_recurrence(base: type) -> type:
    """A subclass of ``base`` with a scriptable forward of its own: a recurrence of its own on the first
    gate's weights (the layer's parameters, names and initialisation reused)."""

    class FirstGate(base):
        def forward(self, input: torch.Tensor, hx: Optional[torch.Tensor] = None) -> torch.Tensor:  # noqa: UP045
            h = torch.zeros(input.size(1), self.hidden_size, dtype=input.dtype)
            outs = []
            for t in range(input.size(0)):
                w_ih, w_hh = self.weight_ih_l0[: self.hidden_size], self.weight_hh_l0[: self.hidden_size]
                h = torch.tanh(input[t] @ w_ih.t() + h @ w_hh.t() + self.offset())
                outs.append(h)
            return torch.stack(outs)

        def offset(self) -> float:
            return 0.5

    return FirstGate


@pytest.mark.parametrize("torch_cls, tandem_cls", PAIRS)
def test_torch_jit_script_of_a_subclass_with_a_forward_of_its_own_compiles_it(torch_cls, tandem_cls):
    """Scripted, a subclass of torch's layer runs its own forward (and methods); of tandem's, torch's
    forward ran in its place, without a word, in the scripted model and in its original after."""
    import warnings

    x = torch.randn(5, 3, 4, dtype=torch.float64)
    results = []
    for cls in (torch_cls, tandem_cls):
        torch.manual_seed(0)
        model = torch.nn.Sequential(_first_gate_recurrence(cls)(4, 6, dtype=torch.float64))
        eager = model(x)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.jit.script is deprecated (torch 2.13)
            scripted = torch.jit.script(model)
        results.append((eager, scripted(x), model(x)))
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(results[1][1], results[1][0], rtol=0, atol=0)


class _Scaling:  # a mixin listed after the layer's class, with an annotated class attribute
    scale: float = 0.5

    def scaled(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


@pytest.mark.parametrize("tandem_cls", [tandem.nn.GRU, tandem.nn.LSTM], ids=["gru", "lstm"])
def test_torch_jit_script_of_subclasses_with_methods_mixins_and_annotations(tandem_cls):
    """A subclass without a forward of its own (its own initialisation, a helper) scripts as the layer
    (a class made to carry its methods was not compilable: "Unsupported value kind: Tensor"), also with
    an interface's forward listed after the layer (it ran in the layer's place); one with a forward of its
    own takes its mixins' methods, annotated attributes, constants and unused properties along."""
    import warnings

    class Init(tandem_cls):
        def reset_parameters(self) -> None:
            for w in self.parameters():
                torch.nn.init.uniform_(w, -0.1, 0.1)

        def describe(self) -> str:
            return "init"

    class Mixed(tandem_cls, _Scaling):
        __constants__ = ["scale"]  # (as on a subclass of torch's layer)

        def forward(self, input: torch.Tensor) -> torch.Tensor:
            return self.scaled(input.sum(-1))

    class Interface(torch.nn.Module):  # listed after the layer: its forward is not the one that runs
        def forward(self, input: torch.Tensor) -> torch.Tensor:
            raise NotImplementedError

    class Encoder(tandem_cls, Interface):
        pass

    class Unused(tandem_cls):  # a property TorchScript cannot compile, marked unused as torch asks
        __jit_unused_properties__ = ["where"]

        @property
        def where(self):
            return object()

        def forward(self, input: torch.Tensor) -> torch.Tensor:
            return input.sum(-1)

    x = torch.randn(5, 3, 4, dtype=torch.float64)
    init = torch.nn.Sequential(Init(4, 6, dtype=torch.float64))
    encoder = torch.nn.Sequential(Encoder(4, 6, dtype=torch.float64))
    want = [init(x)[0], encoder(x)[0]]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit.script is deprecated (torch 2.13)
        torch.testing.assert_close(torch.jit.script(init)(x)[0], want[0])
        torch.testing.assert_close(torch.jit.script(encoder)(x)[0], want[1])
        torch.testing.assert_close(encoder(x)[0], want[1])  # the original after it too
        mixed, unused = torch.nn.Sequential(Mixed(4, 6)), torch.nn.Sequential(Unused(4, 6))
        torch.testing.assert_close(torch.jit.script(mixed)(x), x.sum(-1) * 0.5, rtol=0, atol=0)
        torch.testing.assert_close(torch.jit.script(unused)(x), x.sum(-1), rtol=0, atol=0)


@pytest.mark.parametrize("torch_cls, tandem_cls", PAIRS)
def test_a_weight_set_to_none_is_torchs_type_error(torch_cls, tandem_cls):
    for module in (torch_cls(4, 6), tandem_cls(4, 6)):
        module.weight_hh_l0 = None
        with pytest.raises(TypeError):
            module(torch.randn(5, 3, 4))


@pytest.mark.parametrize("torch_cls, tandem_cls", PAIRS)
def test_a_data_parallel_replica_computes_as_torchs(torch_cls, tandem_cls):
    """torch.nn.DataParallel's replicas hold the weights in the flat-weights cache only (not as
    parameters): the layers read them from there, as torch's do."""
    ref, ours = torch_cls(4, 6, bidirectional=True), tandem_cls(4, 6, bidirectional=True)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(5, 3, 4)
    expected = ref._replicate_for_data_parallel()(x)[0]
    torch.testing.assert_close(ours._replicate_for_data_parallel()(x)[0], expected)


@pytest.mark.parametrize("torch_cls, tandem_cls", PAIRS)
@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("input_grad", [False, True])
@pytest.mark.parametrize(
    "name", ["weight_ih_l0", "weight_hh_l0", "bias_ih_l0", "bias_hh_l0", "weight_ih_l1", "weight_hr_l1"]
)
@pytest.mark.parametrize("frozen", [False, True], ids=["", "frozen"])
def test_a_parameter_changed_between_forward_and_backward_raises_where_torchs_does(
    torch_cls, tandem_cls, bidirectional, input_grad, name, frozen
):
    """An optimizer.step() (any in-place change) between forward and backward: autograd's in-place error
    for the parameters torch's ops save (recurrent and projection weights; input weights when the
    layer's input requires grad), none for the biases, whose gradients are then torch's. A frozen
    parameter (requires_grad=False: a teacher's update while fine-tuning) too: torch's ops save it all
    the same (tandem's backward ran on without a word)."""
    from torch.nn.utils.rnn import pack_padded_sequence

    lstm = torch_cls is torch.nn.LSTM
    if name == "weight_hr_l1" and not lstm:
        pytest.skip("GRU has no projection")
    kwargs = dict(num_layers=2, bidirectional=bidirectional, proj_size=3 if lstm else 0)
    if not lstm:
        kwargs.pop("proj_size")
    ref, ours = torch_cls(4, 5, **kwargs), tandem_cls(4, 5, **kwargs)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(6, 3, 4, requires_grad=input_grad)
    _change_before_backward_as_torch(ref, ours, name, frozen, lambda m: m(pack_padded_sequence(x, [6, 4, 2])))


def _change_before_backward_as_torch(ref, ours, name: str, frozen: bool, forward) -> None:
    """``forward(module)`` of both modules, then their parameter ``name`` changed in place (frozen or not),
    then a backward: tandem's raises autograd's in-place error where torch's does, and runs on to torch's
    gradients where torch's does."""
    outcomes = []
    for module in (ref, ours):
        getattr(module, name).requires_grad_(not frozen)
        out, _ = forward(module)
        with torch.no_grad():
            getattr(module, name).add_(0.1)
        try:
            (out.data if isinstance(out, PackedSequence) else out).square().sum().backward()
            outcomes.append("ran")
        except RuntimeError as e:
            assert "modified by an inplace operation" in str(e)
            outcomes.append("raised")
    assert outcomes[1] == outcomes[0]
    if outcomes[0] == "ran":
        for (n, a), b in zip(ref.named_parameters(), ours.parameters()):
            assert (a.grad is None) == (b.grad is None) == (frozen and n == name), n
            if a.grad is not None:
                torch.testing.assert_close(b.grad, a.grad, msg=n)


@pytest.mark.parametrize("torch_cls, tandem_cls", PAIRS)
@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("h0_grad", [None, False, True], ids=["no-h0", "h0", "h0-grad"])
@pytest.mark.parametrize("name", ["weight_hh_l0", "weight_hh_l1", "weight_ih_l1"])
@pytest.mark.parametrize("frozen", [False, True], ids=["", "frozen"])
@pytest.mark.parametrize("steps", [[3], [3, 0]], ids=["one-step", "and-a-step-of-none"])
@pytest.mark.parametrize("variant", ["float32", "float64", "proj"])
def test_a_parameter_changed_after_a_one_step_forward_raises_where_torchs_does(
    torch_cls, tandem_cls, bidirectional, h0_grad, name, frozen, steps, variant
):
    """With one time step torch's own cell multiplies W_hh by h0 alone and saves it only where h0 requires
    grad: changed in place before backward, it raises nothing there and its gradient (h0's part alone) is
    the same (tandem's layers raised the in-place error). A PackedSequence's second step of batch 0 is a
    step for torch, on a state with grad; and the LSTM's oneDNN cell (float32, no projection) saves W_hh
    at any length."""
    lstm = torch_cls is torch.nn.LSTM
    if variant == "proj" and not lstm:
        pytest.skip("GRU has no projection")
    directions = 2 if bidirectional else 1
    kwargs = dict(num_layers=2, bidirectional=bidirectional, dtype=getattr(torch, variant, torch.float32))
    if variant == "proj":
        kwargs["proj_size"] = 3
    ref, ours = torch_cls(4, 5, **kwargs), tandem_cls(4, 5, **kwargs)
    ours.load_state_dict(ref.state_dict())
    dtype, width = kwargs["dtype"], 3 if variant == "proj" else 5
    x = torch.randn(1, 3, 4, dtype=dtype)
    x = x if steps == [3] else PackedSequence(x[0], torch.tensor(steps))
    h0 = (
        None if h0_grad is None else torch.randn(2 * directions, 3, width, dtype=dtype, requires_grad=h0_grad)
    )
    hx = (h0, torch.randn(2 * directions, 3, 5, dtype=dtype)) if h0 is not None and lstm else h0
    _change_before_backward_as_torch(ref, ours, name, frozen, lambda m: m(x, hx))


@pytest.mark.parametrize("torch_cls, tandem_cls", PAIRS)
@pytest.mark.parametrize("which", ["x", "h0"])
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
@pytest.mark.parametrize("frozen", [False, True], ids=["trained", "frozen"])
def test_an_input_changed_in_place_before_backward_raises_where_torchs_does(
    torch_cls, tandem_cls, which, packed, frozen
):
    """The input or h_0 (requiring grad: input saliency, a learned initial state) changed in place after
    the forward: torch's layers save them only for the weights' gradients, so with the weights frozen
    their backward runs, as tandem's does (its ops saved them all the same, and raised); with trained
    weights both raise autograd's error."""
    from torch.nn.utils.rnn import pack_padded_sequence

    ref, ours = torch_cls(3, 4, dtype=torch.float64), tandem_cls(3, 4, dtype=torch.float64)
    ours.load_state_dict(ref.state_dict())
    outcomes = []
    for module in (ref, ours):
        if frozen:  # (made with requires_grad=True; outside inference mode that cannot be set again)
            module.requires_grad_(False)
        x_leaf = torch.randn(5, 2, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        h_leaf = torch.randn(1, 2, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        x, h0 = x_leaf.requires_grad_() * 1, h_leaf.requires_grad_() * 1
        hx = (h0, torch.zeros_like(h0)) if torch_cls is torch.nn.LSTM else h0
        out, _ = module(pack_padded_sequence(x, [5, 3]) if packed else x, hx)
        out = out.data if packed else out
        with torch.no_grad():
            (x if which == "x" else h0).add_(0.5)
        try:
            out.square().sum().backward()
            outcomes.append((x_leaf.grad, h_leaf.grad))
        except RuntimeError as e:
            assert "inplace" in str(e)  # (torch's words differ where a view of h_0 was changed)
            outcomes.append("raised")
    if outcomes[0] == "raised":
        assert outcomes[1] == "raised"
    else:
        assert outcomes[1] != "raised"
        for expected, got in zip(*outcomes):
            torch.testing.assert_close(got, expected)
    if frozen:
        assert outcomes[0] != "raised"


@pytest.mark.parametrize("enforce_sorted", [False, True], ids=["unsorted", "sorted"])
@pytest.mark.parametrize("torch_cls, tandem_cls", PAIRS)
def test_packed_stack_under_torch_compile_as_torchs(torch_cls, tandem_cls, enforce_sorted):
    """RNN -> batch norm on the packed frames (the PackedSequence rebuilt with _replace) -> RNN, compiled:
    with enforce_sorted=False the layers read the batch as a shape, so the graph has no break (a break
    there made torch 2.13's dynamo hand the second layer an empty PackedSequence); with the default
    enforce_sorted=True they read it from batch_sizes, data to the trace, which fullgraph refused (its
    tests of an empty batch could not be decided). The numbers are eager's, which are torch's."""
    from torch.nn.utils.rnn import pack_padded_sequence

    class Stack(torch.nn.Module):
        def __init__(self, rnn) -> None:
            super().__init__()
            self.a = rnn(4, 6, batch_first=True, bidirectional=True, dtype=torch.float64)
            self.bn = torch.nn.BatchNorm1d(12, dtype=torch.float64)
            self.b = rnn(12, 5, batch_first=True, dtype=torch.float64)

        def forward(self, p):
            p, _ = self.a(p)
            p, _ = self.b(p._replace(data=self.bn(p.data)))
            return p.data

    x, lengths = torch.randn(3, 5, 4, dtype=torch.float64), torch.tensor([3, 5, 2])
    if enforce_sorted:
        x, lengths = x[[1, 0, 2]], lengths[[1, 0, 2]]
    packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=enforce_sorted)  # (not traced)
    torch.manual_seed(0)
    ref = Stack(torch_cls)
    ours = Stack(tandem_cls)
    ours.load_state_dict(ref.state_dict())
    expected = ref(packed)
    torch._dynamo.reset()
    got = torch.compile(ours, backend="eager", fullgraph=True)(packed)  # fullgraph: no break in the layers
    torch.testing.assert_close(got, expected)
    got.square().sum().backward()
    expected.square().sum().backward()
    for (name, a), b in zip(ref.named_parameters(), ours.parameters()):
        torch.testing.assert_close(b.grad, a.grad, msg=name)


def _hand_built(data_rows: int, batch_sizes: list | torch.Tensor, **indices) -> PackedSequence:
    sizes = (
        batch_sizes if isinstance(batch_sizes, torch.Tensor) else torch.tensor(batch_sizes, dtype=torch.long)
    )
    return PackedSequence(torch.randn(data_rows, 5, dtype=torch.float64), sizes, **indices)


HAND_BUILT = {
    "steps of none at the end": lambda: _hand_built(3, [2, 1, 0, 0]),
    "steps of none, unsorted": lambda: _hand_built(
        3, [2, 1, 0], sorted_indices=torch.tensor([1, 0]), unsorted_indices=torch.tensor([1, 0])
    ),
    "no sequences": lambda: _hand_built(0, [0]),
    "increasing": lambda: _hand_built(5, [2, 3]),
    "negative": lambda: _hand_built(1, [2, -1]),
    "fewer rows": lambda: _hand_built(3, [2, 2]),
    "int32": lambda: _hand_built(4, torch.tensor([2, 2], dtype=torch.int32)),
    "float": lambda: _hand_built(4, torch.tensor([2.0, 2.0])),
    "2-D": lambda: _hand_built(4, torch.tensor([[2, 2]])),
    "empty": lambda: _hand_built(0, []),
}


@pytest.mark.parametrize("case", HAND_BUILT)
@pytest.mark.parametrize("torch_cls, tandem_cls", PAIRS)
def test_hand_built_packed_sequences_as_torch_takes_them(torch_cls, tandem_cls, case):
    """A PackedSequence built by hand: torch's results where torch's layers compute (steps of no sequences
    at the end, which they compute through), torch's exception types where they raise (tandem raised
    ValueError for all, and refused the steps of none)."""
    kwargs = dict(num_layers=2, bidirectional=True, dtype=torch.float64)
    ref, ours = torch_cls(5, 6, **kwargs), tandem_cls(5, 6, **kwargs)
    ours.load_state_dict(ref.state_dict())
    torch.manual_seed(0)
    packed = HAND_BUILT[case]()
    results = []
    for module in (ref, ours):
        data = packed.data.clone().requires_grad_()
        try:
            out, hidden = module(packed._replace(data=data))
        except Exception as e:
            results.append(e)
            continue
        (out.data.square().sum() + _states_sum(hidden)).backward()
        results.append((out.data, out.batch_sizes, _states_sum(hidden), data.grad))
    expected, got = results
    if isinstance(expected, Exception):
        assert type(got) is type(expected), (expected, got)
        return
    assert not isinstance(got, Exception), got
    assert torch.equal(got[1], expected[1])
    for name, a, b in zip(("output", "batch_sizes", "states", "input grad"), expected, got):
        torch.testing.assert_close(b, a, msg=name)


@pytest.mark.parametrize("torch_cls, tandem_cls", PAIRS)
def test_packed_data_with_rows_beyond_the_batch_sizes_is_refused(torch_cls, tandem_cls):
    """torch's LSTM raises, its GRU computes over the first sum(batch_sizes) rows and leaves the rest: both
    of tandem's raise the LSTM's RuntimeError, naming the two counts."""
    packed = _hand_built(6, [2, 2])
    with pytest.raises(RuntimeError, match=r"PackedSequence.data of sum\(batch_sizes\) = 4 rows, got 6"):
        tandem_cls(5, 6, dtype=torch.float64)(packed)


@pytest.mark.parametrize("torch_cls, tandem_cls", PAIRS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_tiny_activations_keep_their_digits(torch_cls, tandem_cls, dtype, packed):
    """Inputs and states of the size of 1e-3 to 1e-9 (no bias: every pre-activation is that small).
    tanh(a) was 2 sigmoid(2a) - 1, whose absolute error of one unit of 0.5's last place was 7% of a
    float32 output of 1e-6 and all of one of 1e-9 (float64: 1e-7 of it); now the outputs and final states
    agree with torch's to the rounding of the dtype, relative to their size."""
    from torch.nn.utils.rnn import pack_padded_sequence

    torch.manual_seed(0)
    ref = torch_cls(3, 6, bias=False, bidirectional=True, num_layers=2, dtype=dtype)
    ours = tandem_cls(3, 6, bias=False, bidirectional=True, num_layers=2, dtype=dtype)
    ours.load_state_dict(ref.state_dict())
    tol = 1e-13 if dtype == torch.float64 else 2e-6
    for scale in (1e-3, 1e-6, 1e-9):
        x = torch.randn(5, 3, 3, dtype=dtype) * scale
        states = [torch.randn(4, 3, 6, dtype=dtype) * scale for _ in range(2)]
        hx = tuple(states) if torch_cls is torch.nn.LSTM else states[0]
        inputs = pack_padded_sequence(x, [5, 2, 4], enforce_sorted=False) if packed else x
        with torch.no_grad():
            (want, want_h), (got, got_h) = ref(inputs, hx), ours(inputs, hx)
        if packed:
            want, got = want.data, got.data
        for a, b in [(got, want), *zip(got_h if isinstance(got_h, tuple) else [got_h],
                                       want_h if isinstance(want_h, tuple) else [want_h])]:  # fmt: skip
            torch.testing.assert_close(a, b, rtol=tol, atol=tol * scale)


@pytest.mark.parametrize(
    "attr, value",
    [("batch_first", 0), ("batch_first", 1), ("bias", 1), ("training", 1), ("bidirectional", 0)],
)
@pytest.mark.parametrize("torch_cls, tandem_cls", PAIRS)
def test_a_flag_set_to_a_non_bool_is_refused_as_torch_refuses_it(torch_cls, tandem_cls, attr, value):
    """A setting changed after construction to an int (a config loader's 0 or 1): torch's op raises a
    TypeError; tandem's kernels read it as true or false and computed."""
    said = []
    for cls in (torch_cls, tandem_cls):
        module = cls(3, 4)
        setattr(module, attr, value)
        with pytest.raises(TypeError) as caught:
            module(torch.randn(5, 2, 3))
        said.append(str(caught.value).splitlines()[0])
    assert said[1] == said[0]


@pytest.mark.parametrize(
    "attr, value, when",
    [("num_layers", True, "made"), ("num_layers", True, "set"), ("input_size", 3.0, "set")],
)
@pytest.mark.parametrize("torch_cls, tandem_cls", PAIRS)
def test_a_size_that_is_no_int_is_taken_or_refused_as_torch_does(torch_cls, tandem_cls, attr, value, when):
    """``num_layers=True`` (the constructor takes a bool as an int): torch's op raises a TypeError, and
    tandem's kernels ran one layer. An ``input_size`` of 3.0: torch's forward compares it with the input's
    3 and computes, and tandem's reshape raised a TypeError."""
    said = []
    for cls in (torch_cls, tandem_cls):
        torch.manual_seed(0)
        module = cls(3, 4, **({attr: value} if when == "made" else {}))
        if when == "set":
            setattr(module, attr, value)
        try:
            said.append(module(torch.randn(5, 2, 3))[0])
        except TypeError as e:
            said.append(str(e).splitlines()[0])
    if isinstance(said[0], str):
        assert said[1] == said[0]
    else:
        torch.testing.assert_close(said[1], said[0])


@pytest.mark.parametrize("hx_size", [None, 2, 6])
def test_gru_given_proj_size_positionally_raises_as_torch(hx_size):
    """torch.nn.GRU refuses ``proj_size=`` but not the same value passed positionally: it builds a
    weight_hr and every forward raises a RuntimeError. tandem's ran its kernel and raised a ValueError of
    its own (or computed without the projection)."""
    said = []
    for cls in (torch.nn.GRU, tandem.nn.GRU):
        torch.manual_seed(0)
        module = cls(4, 6, 1, True, False, 0.0, False, 2)
        hx = None if hx_size is None else torch.zeros(1, 3, hx_size)
        with pytest.raises(RuntimeError) as caught:
            module(torch.randn(5, 3, 4), hx)
        said.append(str(caught.value))
    assert said[1] == said[0]


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize(
    "name, kwargs",
    [
        ("GRU", {}),
        ("GRU", {"bidirectional": True, "num_layers": 2}),
        ("LSTM", {}),
        ("LSTM", {"proj_size": 2, "bidirectional": True}),
    ],
    ids=["gru", "gru-bi-L2", "lstm", "lstm-proj-bi"],
)
def test_flop_counter_counts_the_matrix_products_as_torchs(name, kwargs, packed):
    """torch.utils.flop_counter.FlopCounterMode counted nothing in tandem's layers (a custom op is one call
    to it). The forward's count is torch's native layer's (float64: torch runs its native cell); the
    backward's is torch's plus the first step's state-gradient products, which tandem computes (h_0's
    gradient) and torch's autograd skips for an h_0 that needs none."""
    from torch.utils.flop_counter import FlopCounterMode

    counts = []
    for lib in (torch.nn, tandem.nn):
        torch.manual_seed(0)
        module = getattr(lib, name)(3, 5, dtype=torch.float64, **kwargs)
        x = torch.randn(4, 2, 3, dtype=torch.float64, requires_grad=True)
        if packed:
            x = torch.nn.utils.rnn.pack_padded_sequence(x, [4, 3])
        with FlopCounterMode(display=False) as forward:
            out, _ = module(x)
        with FlopCounterMode(display=False) as backward:
            (out if isinstance(out, torch.Tensor) else out.data).sum().backward()
        counts.append((forward.get_total_flops(), backward.get_total_flops()))
    (torch_fwd, torch_bwd), (ours_fwd, ours_bwd) = counts
    assert ours_fwd == torch_fwd > 0
    layers, directions = kwargs.get("num_layers", 1), 1 + kwargs.get("bidirectional", False)
    gates, out_size = (3 if name == "GRU" else 4) * 5, kwargs.get("proj_size", 5)
    first_steps = 2 * layers * directions * 2 * gates * out_size  # batch 2
    assert torch_bwd < ours_bwd <= torch_bwd + first_steps
    if not packed:  # (torch's packed reverse direction computes some of them)
        assert ours_bwd == torch_bwd + first_steps


@pytest.mark.parametrize("proj_size", [0, 2], ids=["", "proj"])
@pytest.mark.parametrize("frozen", [False, True], ids=["trained", "frozen"])
@pytest.mark.parametrize("torch_cls, tandem_cls", PAIRS)
def test_a_module_made_under_inference_mode_as_torch(torch_cls, tandem_cls, frozen, proj_size):
    """Its parameters are inference tensors: torch's layers refuse to save them for backward (a
    RuntimeError); tandem's ops saved copies and every parameter's gradient was silently lost."""
    if proj_size and torch_cls is torch.nn.GRU:
        pytest.skip("GRU has no projection")
    kwargs = {"proj_size": proj_size} if proj_size else {}
    outcomes = []
    for cls in (torch_cls, tandem_cls):
        with torch.inference_mode():
            module = cls(3, 4, **kwargs)
        if frozen:  # (made with requires_grad=True; outside inference mode that cannot be set again)
            module.requires_grad_(False)
        for x_grad in (False, True):
            try:
                out, _ = module(torch.randn(5, 2, 3, requires_grad=x_grad))
                outcomes.append(("ok", out.requires_grad))
            except RuntimeError as e:
                outcomes.append((RuntimeError, str(e)))
        with torch.no_grad():  # and without autograd, both run
            outcomes.append(("ok", module(torch.randn(5, 2, 3))[0].requires_grad))
    theirs, ours = outcomes[:3], outcomes[3:]
    assert ours == theirs
    assert theirs[1][0] is RuntimeError  # not vacuous


class _Traced(torch.nn.Module):
    def __init__(self, rnn: torch.nn.Module, norm: torch.nn.Module) -> None:
        super().__init__()
        self.rnn, self.norm, self.head = rnn, norm, torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, h0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out, _ = self.rnn(x, h0) if isinstance(self.rnn, (torch.nn.GRU, tandem.nn.GRU)) else self.rnn(x)
        return self.head(self.norm(out.permute(1, 2, 0)).permute(2, 0, 1)), out


@pytest.mark.parametrize("torch_cls, tandem_cls", PAIRS)
def test_torch_fx_symbolic_trace_keeps_the_layers_whole_as_torchs(torch_cls, tandem_cls):
    """torch.fx keeps torch.nn's modules whole (leaves) and traced into tandem's, failing ("Proxy object
    cannot be iterated"; SyncBatchNorm: "symbolically traced variables cannot be used as inputs to control
    flow"): the same graph of call_module nodes now, and the traced model computes what the model does."""
    graphs, results = [], []
    x, h0 = torch.randn(5, 2, 3), torch.randn(2, 2, 4)
    for rnn_cls, norm_cls in ((torch_cls, torch.nn.SyncBatchNorm), (tandem_cls, tandem.nn.SyncBatchNorm)):
        torch.manual_seed(0)
        model = _Traced(rnn_cls(3, 4, bidirectional=True), norm_cls(8)).eval()
        traced = torch.fx.symbolic_trace(model)
        graphs.append([(n.op, str(n.target)) for n in traced.graph.nodes])
        results.append((traced(x, h0), model(x, h0)))
    assert graphs[0] == graphs[1] and ("call_module", "rnn") in graphs[1]
    for got, want in results:
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(results[1][0], results[0][0])


class _ScaledGRU(tandem.nn.GRU):  # (at module level: a traced model holding them can be pickled)
    def forward(self, x):
        out, h = super().forward(x)
        return out * 2.0 + 1.0, h


class _ScaledLSTM(tandem.nn.LSTM):
    def forward(self, x):
        out, state = super().forward(x)
        return out * 2.0 + 1.0, state


class _ScaledNorm(tandem.nn.SyncBatchNorm):
    def forward(self, x):
        return super().forward(x) * 2.0 + 1.0


class _PlainGRU(tandem.nn.GRU):
    pass


class _Holder(torch.nn.Module):
    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        self.layer, self.norm = layer, isinstance(layer, tandem.nn.SyncBatchNorm)

    def forward(self, x):
        out = self.layer(x)
        return out if self.norm else out[0]


@pytest.mark.parametrize(
    "layer, node",
    [
        pytest.param(lambda: _ScaledGRU(4, 4), "call_function", id="gru"),
        pytest.param(lambda: _ScaledLSTM(4, 4), "call_function", id="lstm"),
        pytest.param(lambda: _ScaledNorm(5), "call_function", id="syncbn"),
        pytest.param(lambda: _PlainGRU(4, 4), "call_module", id="gru-without-a-forward-of-its-own"),
    ],
)
def test_torch_fx_symbolic_trace_of_a_subclass_that_calls_super_forward_runs_its_own_part_once(layer, node):
    """A subclass's forward is user code, which torch.fx traces into (torch's layers then fail, TraceError);
    its super().forward became a call_module node of the subclass itself, whose whole forward the graph
    then ran before the traced post-processing: that part ran twice (outputs doubled, without a word).
    The graph computes as eager now, saved and loaded too; a subclass without a forward of its own stays a
    leaf (a call_module node)."""
    torch.manual_seed(0)
    model = _Holder(layer()).eval()
    x = torch.randn(3, 5, 4) if isinstance(model.layer, tandem.nn.SyncBatchNorm) else torch.randn(5, 3, 4)
    traced = torch.fx.symbolic_trace(model)
    ops = [n.op for n in traced.graph.nodes]
    assert node in ops and ("call_module" not in ops or node == "call_module")
    want = model(x)
    torch.testing.assert_close(traced(x), want, rtol=0, atol=0)
    buffer = io.BytesIO()
    torch.save(traced, buffer)
    buffer.seek(0)
    torch.testing.assert_close(torch.load(buffer, weights_only=False)(x), want, rtol=0, atol=0)


@pytest.mark.parametrize("torch_cls, tandem_cls", [*PAIRS, (torch.nn.SyncBatchNorm, tandem.nn.SyncBatchNorm)])
def test_torch_fx_symbolic_trace_of_a_layer_itself_fails_as_torchs(torch_cls, tandem_cls):
    """Traced as the root, torch's layers fail on their control flow (TraceError); tandem's SyncBatchNorm
    raised ValueError "expected mask or lengths, got both" (its optional arguments are proxies there)."""
    errors = []
    for cls in (torch_cls, tandem_cls):
        module = cls(4) if cls in (torch.nn.SyncBatchNorm, tandem.nn.SyncBatchNorm) else cls(3, 4)
        with pytest.raises(Exception) as caught:
            torch.fx.symbolic_trace(module)
        errors.append(caught.type)
    assert errors[1] is errors[0] is torch.fx.proxy.TraceError


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("torch_cls, tandem_cls", PAIRS)
def test_weights_changed_before_backward_under_allow_mutation_on_saved_tensors(torch_cls, tandem_cls, packed):
    """Under torch.autograd.graph.allow_mutation_on_saved_tensors() torch's layers take an optimizer step
    between forward and backward (the gradients are those of the weights at forward time); tandem's version
    check raised autograd's in-place error there."""
    grads = []
    x = torch.randn(5, 2, 3, dtype=torch.float64)
    for cls in (torch_cls, tandem_cls):
        torch.manual_seed(0)
        module = cls(3, 4, num_layers=2, bidirectional=True, dtype=torch.float64)
        with torch.autograd.graph.allow_mutation_on_saved_tensors():
            inp = pack_padded_sequence(x, [5, 3]) if packed else x
            out, _ = module(inp)
            with torch.no_grad():
                for p in module.parameters():
                    p.mul_(0.5)
            (out.data if packed else out).square().sum().backward()
        grads.append({n: p.grad for n, p in module.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], msg=name)


@pytest.mark.parametrize("inference", ["input", "state"])
@pytest.mark.parametrize("torch_cls, tandem_cls", PAIRS)
def test_an_inference_input_or_state_of_a_frozen_layer_as_torch(torch_cls, tandem_cls, inference):
    """Frozen weights, an input or initial state made under inference_mode and the other requiring grad:
    torch's layers run (nothing saves the inference tensor); tandem's refusal of inference tensors must
    keep to the weights."""
    results = []
    for cls in (torch_cls, tandem_cls):
        torch.manual_seed(0)
        module = cls(3, 4).requires_grad_(False)
        with torch.inference_mode():
            made = torch.randn(5, 2, 3) if inference == "input" else torch.randn(1, 2, 4)
        x = made if inference == "input" else torch.randn(5, 2, 3, requires_grad=True)
        h0 = made if inference == "state" else torch.randn(1, 2, 4, requires_grad=True)
        hx = h0 if cls in (torch.nn.GRU, tandem.nn.GRU) else (h0, torch.zeros(1, 2, 4))
        try:
            out, _ = module(x, hx)
            out.sum().backward()
            results.append(("ok", (x if inference == "state" else h0).grad))
        except RuntimeError as e:
            results.append((RuntimeError, str(e)))
    theirs, ours = results
    assert ours[0] == theirs[0], (ours, theirs)
    if theirs[0] == "ok":
        torch.testing.assert_close(ours[1], theirs[1])


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize(
    "method", ["check_forward_args", "get_expected_hidden_size", "check_hidden_size", "check_input"]
)
@pytest.mark.parametrize("torch_cls, tandem_cls", PAIRS)
def test_a_subclass_overriding_the_checks_is_checked_as_torchs(torch_cls, tandem_cls, method, packed):
    """torch's forward checks through ``self.check_forward_args`` (and what it calls), so a subclass's
    override runs; its LSTM checks packed input in its op, with no Python check. tandem called its own
    checks directly: an override of check_forward_args or get_expected_hidden_size never ran, and a
    packed LSTM ran a subclass's check_input."""

    def outcome(base):
        def refuse(self, *args, **kwargs):
            raise ValueError(f"the subclass's {method}")

        sub = type("Checked", (base,), {method: refuse})
        torch.manual_seed(0)
        x = torch.randn(4, 2, 3)
        try:
            sub(3, 5)(pack_padded_sequence(x, [4, 2]) if packed else x)
        except ValueError as e:
            return str(e)
        return None

    assert outcome(tandem_cls) == outcome(torch_cls)
