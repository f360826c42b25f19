"""tandem.nn.LSTM against torch.nn.LSTM (which we did not write), with copied weights."""

from __future__ import annotations

import pytest
import torch
from torch.nn.utils.rnn import pack_padded_sequence

import tandem
from tandem.ops.lstm.onednn import _onednn_enabled, torch_runs_onednn_when_packed_uniform


@pytest.mark.parametrize("proj_size", [0, 3])
def test_state_dict_and_init_match_torch(proj_size: int):
    kwargs = dict(num_layers=2, bidirectional=True, proj_size=proj_size)
    torch.manual_seed(3)
    ref = torch.nn.LSTM(6, 8, **kwargs)
    torch.manual_seed(3)
    ours = tandem.nn.LSTM(6, 8, **kwargs)
    assert list(ours.state_dict()) == list(ref.state_dict())
    assert ("weight_hr_l1_reverse" in ours.state_dict()) == bool(proj_size)
    for (name, a), b in zip(ref.state_dict().items(), ours.state_dict().values()):
        assert torch.equal(a, b), name  # same initialisation draws in the same order
    back = torch.nn.LSTM(6, 8, **kwargs)
    back.load_state_dict(ours.state_dict())
    assert str(ours) == str(ref)


@pytest.mark.parametrize("used", ["output", "h_n", "c_n"])
def test_single_output_in_the_loss_matches_torch(used: str):
    ref = torch.nn.LSTM(5, 6, bidirectional=True, dtype=torch.float64)
    ours = tandem.nn.LSTM(5, 6, bidirectional=True, dtype=torch.float64)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(4, 3, 5, dtype=torch.float64)
    for module in (ref, ours):
        out, (h_n, c_n) = module(x)
        dict(output=out, h_n=h_n, c_n=c_n)[used].square().sum().backward()
    for (name, a), b in zip(ref.named_parameters(), ours.parameters()):
        torch.testing.assert_close(b.grad, a.grad, msg=name)


def _hx(layers: int, batch: int | None, hid: int = 7, cell: int = 7, **kw):
    b = () if batch is None else (batch,)
    return torch.randn(layers, *b, hid, **kw), torch.randn(layers, *b, cell, **kw)


def _packed(x: torch.Tensor, sort: bool = True):
    lengths = [4, 3] if sort else [3, 4]
    return torch.nn.utils.rnn.pack_padded_sequence(x, lengths, enforce_sorted=sort)


BAD_INPUTS = {
    "wrong-input-size": (dict(), lambda: (torch.randn(4, 2, 6), None)),
    "wrong-h0-shape": (dict(), lambda: (torch.randn(4, 2, 5), _hx(1, 3))),
    "wrong-c0-shape": (dict(), lambda: (torch.randn(4, 2, 5), (torch.randn(1, 2, 7), torch.randn(1, 2, 6)))),
    "wrong-c0-batch": (dict(), lambda: (torch.randn(4, 2, 5), (torch.randn(1, 2, 7), torch.randn(1, 3, 7)))),
    "proj-h0-hidden-size": (dict(proj_size=3), lambda: (torch.randn(4, 2, 5), _hx(1, 2))),
    "proj-c0-proj-size": (dict(proj_size=3), lambda: (torch.randn(4, 2, 5), _hx(1, 2, 3, 3))),
    "4d-input": (dict(), lambda: (torch.randn(4, 2, 5, 1), None)),
    "unbatched-with-3d-hx": (dict(), lambda: (torch.randn(4, 5), _hx(1, 1))),
    "batched-with-2d-hx": (dict(), lambda: (torch.randn(4, 2, 5), _hx(1, None))),
    "batched-with-2d-c0": (dict(), lambda: (torch.randn(4, 2, 5), (torch.randn(1, 2, 7), torch.randn(1, 7)))),
    "input-dtype": (dict(), lambda: (torch.randn(4, 2, 5, dtype=torch.float64), None)),
    "input-device": (dict(), lambda: (torch.randn(4, 2, 5, device="meta"), None)),
    "h0-device": (dict(), lambda: (torch.randn(4, 2, 5), _hx(1, 2, device="meta"))),
    "bi-hx-layers": (dict(bidirectional=True), lambda: (torch.randn(4, 2, 5), _hx(1, 2))),
    # torch's LSTM checks nothing of a packed input: its op's errors
    "packed-input-dtype": (dict(), lambda: (_packed(torch.randn(4, 2, 5, dtype=torch.float64)), None)),
    "packed-integer-input": (dict(), lambda: (_packed(torch.randint(0, 3, (4, 2, 5))), None)),
    "packed-with-2d-hx": (dict(), lambda: (_packed(torch.randn(4, 2, 5)), _hx(1, None))),
    "packed-with-2d-c0": (
        dict(),
        lambda: (_packed(torch.randn(4, 2, 5), sort=False), (torch.randn(1, 2, 7), torch.randn(2, 7))),
    ),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input_raises_like_torch(name: str):
    kwargs, make = BAD_INPUTS[name]
    ref, ours = torch.nn.LSTM(5, 7, **kwargs), tandem.nn.LSTM(5, 7, **kwargs)
    x, hx = make()
    with pytest.raises(Exception) as expected:
        ref(x, hx)
    with pytest.raises(type(expected.value)) as got:
        ours(x, hx)
    assert str(got.value), "the error must say what was expected and what came"


def test_hidden_dtype_mismatch_is_a_clear_error():
    hx = (torch.randn(1, 2, 7), torch.randn(1, 2, 7, dtype=torch.float64))
    with pytest.raises(RuntimeError, match=r"cx of dtype torch.float32 .* got torch.float64"):
        tandem.nn.LSTM(5, 7)(torch.randn(4, 2, 5), hx)


@pytest.mark.parametrize("proj_size", [0, 3])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("cx_dtype", [torch.float32, torch.float16])
def test_float64_input_takes_a_narrower_cx_as_torch_does(proj_size: int, packed: bool, cx_dtype: torch.dtype):
    # torch's native CPU cell (float64 input) promotes c_0 in its first step; a c_0 that came in
    # narrower gets its gradient back in its own dtype
    kwargs = dict(num_layers=2, bidirectional=True, proj_size=proj_size, dtype=torch.float64)
    torch.manual_seed(0)
    ref = torch.nn.LSTM(5, 7, **kwargs)
    ours = tandem.nn.LSTM(5, 7, **kwargs)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(4, 3, 5, dtype=torch.float64)
    h0 = torch.randn(4, 3, proj_size or 7, dtype=torch.float64)
    c0 = torch.randn(4, 3, 7).to(cx_dtype)
    results = []
    for module in (ref, ours):
        hx = (h0.clone().requires_grad_(), c0.clone().requires_grad_())
        inp = pack_padded_sequence(x, [4, 2, 3], enforce_sorted=False) if packed else x
        out, (h_n, c_n) = module(inp, hx)
        out = out.data if packed else out
        (out.sum() + h_n.square().sum() + c_n.square().sum()).backward()
        results.append((out, h_n, c_n, hx[0].grad, hx[1].grad))
    for name, a, b in zip(("output", "h_n", "c_n", "h0.grad", "c0.grad"), *results):
        assert b.dtype == a.dtype, name
        torch.testing.assert_close(b, a, msg=name)
    assert results[1][4].dtype == cx_dtype


@pytest.mark.filterwarnings("ignore:TF32 acceleration on top of oneDNN")  # torch.backends.mkldnn.flags's
@pytest.mark.parametrize("onednn", [True, False])
@pytest.mark.parametrize("proj_size", [0, 3])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("cx_dtype", [torch.float16, torch.bfloat16])
def test_float32_input_takes_a_narrower_cx_where_torchs_native_cell_runs(
    onednn: bool, proj_size: int, packed: bool, cx_dtype: torch.dtype
):
    # torch's native CPU cell (packed input, a projection, oneDNN off) promotes c_0 in its first step;
    # oneDNN's (dense float32 input, no projection) refuses it, and so does tandem there
    torch.manual_seed(0)
    ref = torch.nn.LSTM(5, 7, num_layers=2, bidirectional=True, proj_size=proj_size)
    ours = tandem.nn.LSTM(5, 7, num_layers=2, bidirectional=True, proj_size=proj_size)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(4, 3, 5)
    h0 = torch.randn(4, 3, proj_size or 7)
    c0 = torch.randn(4, 3, 7).to(cx_dtype)
    results = []
    with torch.backends.mkldnn.flags(enabled=onednn):
        for module in (ref, ours):
            hx = (h0.clone().requires_grad_(), c0.clone().requires_grad_())
            inp = pack_padded_sequence(x, [4, 2, 3], enforce_sorted=False) if packed else x
            try:
                out, (h_n, c_n) = module(inp, hx)
            except RuntimeError as e:
                results.append(e)
                continue
            out = out.data if packed else out
            (out.sum() + h_n.square().sum() + c_n.square().sum()).backward()
            results.append((out, h_n, c_n, hx[0].grad, hx[1].grad))
    if onednn and not packed and proj_size == 0:
        assert isinstance(results[0], RuntimeError) and isinstance(results[1], RuntimeError), results
        return
    for name, a, b in zip(("output", "h_n", "c_n", "h0.grad", "c0.grad"), *results):
        assert b.dtype == a.dtype, name
        torch.testing.assert_close(b, a, msg=name)
    assert results[1][4].dtype == cx_dtype and results[1][2].dtype == torch.float32


def test_float64_input_refuses_a_narrower_hx_as_torch_does():
    hx = (torch.randn(1, 2, 7), torch.randn(1, 2, 7, dtype=torch.float64))
    x = torch.randn(4, 2, 5, dtype=torch.float64)
    with pytest.raises(RuntimeError):
        torch.nn.LSTM(5, 7, dtype=torch.float64)(x, hx)
    with pytest.raises(RuntimeError, match=r"hx of dtype torch.float64 .* got torch.float32"):
        tandem.nn.LSTM(5, 7, dtype=torch.float64)(x, hx)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(input_size=0, hidden_size=4),
        dict(input_size=3, hidden_size=0),
        dict(input_size=3, hidden_size=-2),
        dict(input_size=3, hidden_size=4, num_layers=0),
        dict(input_size=3, hidden_size=4, dropout=1.5),
        dict(input_size=3.0, hidden_size=4),
        dict(input_size=3, hidden_size=4, proj_size=4),
        dict(input_size=3, hidden_size=4, proj_size=7),
        dict(input_size=3, hidden_size=4, proj_size=-1),
    ],
    ids=[
        "input0",
        "hidden0",
        "hidden-neg",
        "layers0",
        "dropout",
        "float-size",
        "proj-eq",
        "proj-gt",
        "proj-neg",
    ],
)
def test_bad_constructor_arguments_raise_like_torch(kwargs):
    with pytest.raises(Exception) as expected:
        torch.nn.LSTM(**kwargs)
    with pytest.raises(type(expected.value), match=str(expected.value).split(".")[0][:30]):
        tandem.nn.LSTM(**kwargs)


@pytest.mark.parametrize(
    "backend, proj_size", [("aot_eager", 3), ("inductor", 3), ("aot_eager", 0)], ids=lambda v: str(v)
)
def test_torch_compile_fullgraph_equals_eager(backend: str, proj_size: int, tmp_path, monkeypatch):
    """proj_size=0: the query whether torch would run oneDNN, which torch.compile could not trace, broke
    the graph of dense float32 input (fullgraph=True raised)."""
    # a private compile cache: inductor's on-disk cache keys do not cover custom-op schemas
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch.compiler.reset()

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm = tandem.nn.LSTM(
                5, 8, num_layers=2, bidirectional=True, batch_first=True, proj_size=proj_size
            )
            self.head = torch.nn.Linear(2 * (proj_size or 8) + 8, 3)

        def forward(self, x):
            out, (h_n, c_n) = self.lstm(x)
            return self.head(torch.cat([out.mean(1), c_n[-1]], 1)) + h_n.sum()

    model = Model()
    x = torch.randn(4, 6, 5, requires_grad=True)
    eager = model(x)
    eager_grads = torch.autograd.grad(eager.sum(), [x, *model.parameters()])
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    got = compiled(x)
    got_grads = torch.autograd.grad(got.sum(), [x, *model.parameters()])
    torch.testing.assert_close(got, eager)
    for a, b in zip(got_grads, eager_grads):
        torch.testing.assert_close(a, b)


def test_the_onednn_query_is_marked_constant_as_torch_compiler_marks_a_function():
    """tandem marks the query itself rather than import torch._dynamo at ``import tandem`` (the test above
    is what fails where Dynamo ignores the mark): the mark must be all torch's decorator sets, on the
    function itself."""

    def query() -> bool:
        return True

    assert torch.compiler.assume_constant_result(query) is query
    assert vars(_onednn_enabled) == vars(query) != {}


_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.aten, "mkldnn_rnn_layer")
needs_onednn = pytest.mark.skipif(not _ONEDNN, reason="this torch has no oneDNN LSTM layer op")


_ONEDNN_BF16 = _ONEDNN and torch.ops.mkldnn._is_mkldnn_bf16_supported()


@needs_onednn
@pytest.mark.parametrize(
    "kwargs",
    [dict(), dict(num_layers=2, bidirectional=True, batch_first=True), dict(bias=False, bidirectional=True)],
    ids=["uni", "L2-bi-bf", "bi-nobias"],
)
@pytest.mark.parametrize("states", [False, True], ids=["", "hx"])
@pytest.mark.parametrize(
    "dtypes",
    [
        (torch.float32, torch.float32),
        pytest.param(
            (torch.bfloat16, torch.bfloat16),
            marks=pytest.mark.skipif(not _ONEDNN_BF16, reason="oneDNN computes no bfloat16 on this CPU"),
        ),
        pytest.param(
            (torch.bfloat16, torch.float32),
            marks=pytest.mark.skipif(not _ONEDNN_BF16, reason="oneDNN computes no bfloat16 on this CPU"),
        ),
    ],
    ids=["float32", "bfloat16", "bfloat16-float32-c0"],
)
def test_dense_runs_torchs_onednn_kernel_bit_for_bit(kwargs, states: bool, dtypes):
    """Where torch.nn.LSTM runs oneDNN (dense float32 CPU input, no projection; bfloat16 where the CPU
    computes it, whose cell state may be float32) tandem runs the same primitive: outputs and every
    gradient are equal to torch's, not just close (bfloat16 ran tandem's kernel, a few units of the last
    place off, and a float32 c_0 was refused)."""
    dtype, c_dtype = dtypes
    ref = torch.nn.LSTM(5, 7, dtype=dtype, **kwargs)
    ours = tandem.nn.LSTM(5, 7, dtype=dtype, **kwargs)
    ours.load_state_dict(ref.state_dict())
    layers = kwargs.get("num_layers", 1) * (2 if kwargs.get("bidirectional") else 1)
    x = torch.randn(4, 6, 5) if kwargs.get("batch_first") else torch.randn(6, 4, 5)  # batch 4
    x = x.to(dtype)
    hx = (torch.randn(layers, 4, 7, dtype=dtype), torch.randn(layers, 4, 7, dtype=c_dtype))
    if c_dtype != dtype:
        states = True
    results = []
    for module in (ref, ours):
        inputs = [x.clone().requires_grad_()] + ([t.clone().requires_grad_() for t in hx] if states else [])
        out, (h_n, c_n) = module(inputs[0], tuple(inputs[1:]) if states else None)
        weights = torch.linspace(-1, 1, out.numel()).view_as(out)
        loss = (out.float() * weights).sum() + h_n.float().sum() + 2 * c_n.float().sum()
        grads = torch.autograd.grad(loss, inputs + list(module.parameters()))
        results.append((out, h_n, c_n, *grads))
    assert results[1][2].dtype == c_dtype
    for expected, got in zip(*results):
        assert got.dtype == expected.dtype and torch.equal(got, expected)


@needs_onednn
@pytest.mark.parametrize("strided", ["input", "h0", "c0"])
def test_onednn_path_takes_non_contiguous_tensors_bit_for_bit(strided: str):
    """The oneDNN path given strided tensors (a permuted convolution output, as a DeepSpeech model feeds
    its recurrent stack; sliced states) gives torch's numbers: oneDNN reads its arguments as dense
    arrays, and tandem once handed it the strided memory (every output element off by up to ~0.7)."""
    ref = torch.nn.LSTM(2, 3, num_layers=2, bidirectional=True)
    ours = tandem.nn.LSTM(2, 3, num_layers=2, bidirectional=True)
    ours.load_state_dict(ref.state_dict())
    args = dict(input=torch.randn(4, 5, 2), h0=torch.randn(4, 5, 3), c0=torch.randn(4, 5, 3))
    args[strided] = torch.repeat_interleave(args[strided], 2, dim=-1)[..., ::2]  # the same values, strided
    results = []
    for module in (ref, ours):
        leaves = {n: t.detach().requires_grad_() for n, t in args.items()}
        if module is ref:  # torch gets them contiguous
            leaves = {n: t.detach().contiguous().requires_grad_() for n, t in args.items()}
        out, (h_n, c_n) = module(leaves["input"], (leaves["h0"], leaves["c0"]))
        loss = (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum() + h_n.sum() + 2 * c_n.sum()
        results.append((out, h_n, c_n, *torch.autograd.grad(loss, list(leaves.values()))))
    for expected, got in zip(*results):
        assert torch.equal(got, expected)


class _Calls:
    def __init__(self, fn):
        self.fn, self.count = fn, 0

    def __call__(self, *args, **kwargs):
        self.count += 1
        return self.fn(*args, **kwargs)


@needs_onednn
@pytest.mark.parametrize(
    "case",
    ["dense", "packed", "proj", "float64", "mkldnn-disabled", "bfloat16", "float16"],
    ids=lambda c: c.replace("-", "_"),
)
def test_onednn_serves_exactly_where_torch_uses_it(case: str, monkeypatch):
    """oneDNN for dense float32 input without projection, with oneDNN enabled, and bfloat16 where the CPU
    computes it; tandem's kernel for the rest (packed input, proj_size, float64, float16 in grad mode,
    ``torch.backends.mkldnn.flags(enabled=False)``)."""
    from tandem.nn import lstm as lstm_module

    onednn = _Calls(lstm_module.lstm_layer_onednn)
    own = _Calls(lstm_module.lstm_layer)
    monkeypatch.setattr(lstm_module, "lstm_layer_onednn", onednn)
    monkeypatch.setattr(lstm_module, "lstm_layer", own)
    dtype = {"float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(
        case, torch.float32
    )
    model = tandem.nn.LSTM(3, 4, num_layers=2, proj_size=2 if case == "proj" else 0, dtype=dtype)
    x = torch.randn(5, 2, 3, dtype=dtype)
    inp = pack_padded_sequence(x, [5, 3]) if case == "packed" else x
    with torch.backends.mkldnn.flags(enabled=case != "mkldnn-disabled"):
        model(inp)
    onednn_cases = ("dense", "bfloat16") if _ONEDNN_BF16 else ("dense",)
    assert (onednn.count, own.count) == ((2, 0) if case in onednn_cases else (0, 2))


@pytest.mark.parametrize(
    "form",
    [
        "tensor",
        "packed-tensor",
        "three",
        "one",
        "list",
        "packed-three",
        "unbatched-three",
        "packed-one",
        "packed-nested",
        "unsorted-packed-one",
        "unsorted-packed-nested",
    ],
)
def test_malformed_hx_is_refused_or_taken_as_torch(form):
    """hx must be a pair: torch's lstm op refuses a tensor (TypeError, with packed input too, where tandem
    raised its size check's RuntimeError) and three states (RuntimeError), a single state fails at hx[1]
    (with sorted packed input the op's RuntimeError and TypeError, where tandem raised IndexError and
    AttributeError);
    packed and unbatched input make a pair of hx first, in torch's forward as in tandem's, so a third
    state is dropped there without a word."""
    from torch.nn.utils.rnn import pack_sequence

    torch.manual_seed(0)
    ref = torch.nn.LSTM(3, 4)
    ours = tandem.nn.LSTM(3, 4)
    ours.load_state_dict(ref.state_dict())
    z = torch.randn(1, 2, 4)
    x = torch.randn(5, 2, 3)
    hx = {
        "tensor": torch.randn(2, 1, 2, 4),
        "packed-tensor": z,
        "three": (z, z, z),
        "one": (z,),
        "list": [z, z],
        "packed-three": (z, z, z),
        "unbatched-three": (z[:, 0], z[:, 0], z[:, 0]),
        "packed-one": (z,),
        "packed-nested": ((z,), z),
        "unsorted-packed-one": (z,),
        "unsorted-packed-nested": ((z,), z),
    }[form]
    if form.startswith("packed"):
        x = pack_sequence([torch.randn(4, 3), torch.randn(2, 3)])
    elif form.startswith("unsorted-packed"):
        x = pack_sequence([torch.randn(2, 3), torch.randn(4, 3)], enforce_sorted=False)
    elif form == "unbatched-three":
        x = x[:, 0]
    outcomes = []
    for module in (ref, ours):
        try:
            out = module(x, hx)[0]
            outcomes.append(out.data if form == "packed-three" else out)
        except Exception as e:
            outcomes.append(type(e))
    if isinstance(outcomes[0], torch.Tensor):
        torch.testing.assert_close(outcomes[1], outcomes[0])
    else:
        assert outcomes[1] is outcomes[0]


@pytest.mark.parametrize("num_layers", [1, 2])
@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("layout", ["dense", "packed", "unsorted"])
@pytest.mark.parametrize("learned", ["c0", "c0+h0", "c0+weights"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_c0_changed_in_place_before_backward_as_torch(num_layers, bidirectional, layout, learned, dtype):
    """A learned initial cell state changed in place after the forward: torch's cell saves c_0 only for
    the forget gate's gradient, so where nothing of the first step but c_0 is learned its backward runs
    (tandem's op saved c_0 whatever read it, and raised); elsewhere both raise autograd's error. Where
    both run, c_0's gradients are torch's (those of c_0 as it was)."""
    ref = torch.nn.LSTM(3, 4, num_layers=num_layers, bidirectional=bidirectional, dtype=dtype)
    ours = tandem.nn.LSTM(3, 4, num_layers=num_layers, bidirectional=bidirectional, dtype=dtype)
    ours.load_state_dict(ref.state_dict())
    gen = torch.Generator().manual_seed(0)
    layers = num_layers * (2 if bidirectional else 1)
    x = torch.randn(5, 3, 3, generator=gen, dtype=dtype)
    h_leaf, c_leaf = (torch.randn(layers, 3, 4, generator=gen, dtype=dtype) for _ in range(2))
    outcomes = []
    for module in (ref, ours):
        module.requires_grad_(learned == "c0+weights")
        h_grad, c_grad = h_leaf.clone().requires_grad_(learned == "c0+h0"), c_leaf.clone().requires_grad_()
        h0, c0 = h_grad * 1, c_grad * 1
        if layout == "dense":
            inputs = x
        else:
            inputs = pack_padded_sequence(x, [5, 4, 2] if layout == "packed" else [2, 5, 4],
                                          enforce_sorted=layout == "packed")  # fmt: skip
        out, (h_n, c_n) = module(inputs, (h0, c0))
        with torch.no_grad():
            c0.add_(0.5)
        try:
            loss = (out.data if layout != "dense" else out).square().sum() + c_n.sum()
            loss.backward()
            outcomes.append(c_grad.grad)
        except RuntimeError as e:
            assert "inplace" in str(e)
            outcomes.append("raised")
    if isinstance(outcomes[0], str):
        assert outcomes[1] == "raised"
    else:
        assert not isinstance(outcomes[1], str), "tandem raised where torch ran"
        torch.testing.assert_close(outcomes[1], outcomes[0])


@needs_onednn
@pytest.mark.parametrize("enforce_sorted", [True, False], ids=["sorted", "unsorted"])
@pytest.mark.parametrize("lengths", [[4, 4, 4], [1, 1, 1], [4, 4, 3]], ids=["equal", "ones", "ragged"])
def test_packed_batch_of_equal_lengths_runs_onednn_as_torch(enforce_sorted, lengths):
    """torch.nn.LSTM runs oneDNN's cell on a PackedSequence whose sequences are all as long (its rows are
    a padded batch's): tandem's did its own kernel there, a few units of the last place off, and took
    c_0 dtypes torch refuses. Outputs and gradients equal torch's; a ragged batch stays tandem's kernel.
    torch 2.11 runs its native loop on every PackedSequence (tandem's did oneDNN there: the bits of another
    kernel): there tandem's own kernel runs, and the c_0 dtypes are those of torch's native cell."""
    onednn = torch_runs_onednn_when_packed_uniform()
    if torch.__version__ >= "2.13" or torch.__version__ < "2.12":  # (2.12 not known)
        assert onednn == (torch.__version__ >= "2.13"), "torch 2.13 unwraps a uniform batch, 2.11 does not"
    ref = torch.nn.LSTM(3, 5, num_layers=2, bidirectional=True)
    ours = tandem.nn.LSTM(3, 5, num_layers=2, bidirectional=True)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(4, 3, 3)
    results = []
    for module in (ref, ours):
        leaf = x.clone().requires_grad_()
        out, (h_n, c_n) = module(pack_padded_sequence(leaf, lengths, enforce_sorted=enforce_sorted))
        loss = (out.data * torch.linspace(-1, 1, out.data.numel()).view_as(out.data)).sum() + c_n.sum()
        results.append((out.data, h_n, c_n, *torch.autograd.grad(loss, [leaf, *module.parameters()])))
    for expected, got in zip(*results):
        if lengths == [4, 4, 3] or not onednn:
            torch.testing.assert_close(got, expected)
        else:
            assert torch.equal(got, expected)
    c0_half = (torch.zeros(4, 3, 5), torch.zeros(4, 3, 5, dtype=torch.float16))
    outcomes = []
    for module in (ref, ours):
        try:
            module(pack_padded_sequence(x, lengths, enforce_sorted=enforce_sorted), c0_half)
            outcomes.append("ran")
        except RuntimeError:
            outcomes.append("raised")
    assert outcomes[1] == outcomes[0]


@pytest.mark.parametrize("steps", [1, 3])
@pytest.mark.parametrize("used", ["c_n", "h_n", "output"])
@pytest.mark.parametrize("layers", [1, 2])
def test_projection_gradient_is_none_where_torchs_is(steps, used, layers):
    """With a projection, a loss on c_n alone after one step: the last layer's weight_hr made only the
    output and h_n, so torch leaves its gradient None (an optimizer skips it: no weight decay, no step
    counted); tandem's was a tensor of zeros. Every other gradient, None or not, as torch's."""
    ref = torch.nn.LSTM(2, 3, proj_size=1, num_layers=layers, dtype=torch.float64)
    ours = tandem.nn.LSTM(2, 3, proj_size=1, num_layers=layers, dtype=torch.float64)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(steps, 2, 2, dtype=torch.float64)
    grads = []
    for module in (ref, ours):
        out, (h_n, c_n) = module(x)
        {"c_n": c_n, "h_n": h_n, "output": out}[used].sum().backward()
        grads.append({n: p.grad for n, p in module.named_parameters()})
    for name, expected in grads[0].items():
        got = grads[1][name]
        assert (got is None) == (expected is None), name
        if expected is not None:
            torch.testing.assert_close(got, expected, msg=name)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("x_dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_packed_input_of_another_dtype_is_refused_in_torchs_words(x_dtype, bias):
    """torch.nn.LSTM's packed path refuses an input unlike its weights in its first matrix product
    (RuntimeError "mat1 and mat2 must have the same dtype ..." with a bias, another sentence without):
    tandem's said its own check's words, under torch's type."""
    ref, ours = torch.nn.LSTM(3, 4, bias=bias), tandem.nn.LSTM(3, 4, bias=bias)
    x = pack_padded_sequence(torch.randn(5, 2, 3, dtype=x_dtype), [5, 3])
    said = []
    for module in (ref, ours):
        with pytest.raises(RuntimeError) as caught:
            module(x)
        said.append(str(caught.value))
    assert said[1] == said[0]


@pytest.mark.parametrize("enforce_sorted", [True, False], ids=["sorted", "unsorted"])
@pytest.mark.parametrize("hx_kind", ["tolist", "numpy", "numpy-pair", "tensor-and-int"])
def test_packed_input_with_a_malformed_state_raises_as_torch(hx_kind, enforce_sorted):
    """A PackedSequence with a state that is no pair of tensors: torch's permutation of it, or its op's
    argument parser, refuses it (a TypeError naming the type as Python does, ``numpy.ndarray``); tandem's
    said "lstm expects two hidden states" for a list of lists and "'int' object is not callable" for an
    array."""
    h = torch.zeros(1, 3, 4)
    hx = {
        "tolist": h.tolist(),
        "numpy": h.numpy(),
        "numpy-pair": (h.numpy(), h.numpy()),
        "tensor-and-int": (h, 1),
    }
    torchs, tandems = _packed_call_errors(hx[hx_kind], enforce_sorted)
    assert (type(tandems), str(tandems)) == (type(torchs), str(torchs))


def _packed_call_errors(hx, enforce_sorted: bool) -> list[BaseException]:
    """What torch.nn.LSTM and tandem.nn.LSTM raise for a packed batch of 3 sequences with state ``hx``."""
    said = []
    for cls in (torch.nn.LSTM, tandem.nn.LSTM):
        torch.manual_seed(0)
        lengths = [5, 4, 2] if enforce_sorted else [2, 5, 4]
        packed = pack_padded_sequence(torch.randn(5, 3, 3), lengths, enforce_sorted=enforce_sorted)
        with pytest.raises(Exception) as caught:
            cls(3, 4)(packed, hx)
        said.append(caught.value)
    return said


@pytest.mark.parametrize("enforce_sorted", [True, False], ids=["sorted", "unsorted"])
@pytest.mark.parametrize(
    "shapes",
    [((1, 3, 4, 1), (1, 3, 4)), ((1, 3, 4), (1, 3, 4, 1)), ((1, 3, 4, 1), (1, 12)), ((1, 2, 4), (1, 12))],
    ids=["4d-h", "4d-c", "4d-h-2d-c", "2-sequences-h-2d-c"],
)
def test_packed_input_with_states_of_other_dims_raises_torchs_type(shapes, enforce_sorted):
    """torch.nn.LSTM checks no packed input's states before it permutes them (an index_select over the
    sequences: a RuntimeError for a state of fewer sequences than the batch) and runs its op, which
    raises an IndexError for a state of fewer than 3 dims and a RuntimeError for one of more; tandem's
    raised IndexError for any state not of 3 dims, before the permutation."""
    torchs, tandems = _packed_call_errors(tuple(torch.zeros(s) for s in shapes), enforce_sorted)
    assert type(tandems) is type(torchs)


def test_importing_tandem_draws_nothing_from_torchs_generator():
    """tandem asks torch at import whether it runs oneDNN on a packed batch of equal lengths: with an LSTM
    of fixed weights, not a freshly initialised one, so a script seeded before ``import tandem`` draws the
    numbers it drew without tandem."""
    import subprocess
    import sys

    def first_draw(imports: str) -> str:
        code = f"import torch; torch.manual_seed(0); {imports}; print(torch.rand(3).tolist())"
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout

    assert first_draw("import tandem, tandem.nn") == first_draw("pass")
