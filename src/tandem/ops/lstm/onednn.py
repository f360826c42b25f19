"""The CPU LSTM layer that runs oneDNN's fused LSTM, the kernel torch.nn.LSTM itself runs on CPUs.

On a CPU, torch.nn.LSTM hands dense float32 layers without a projection to oneDNN, and bfloat16 ones where
the CPU computes bfloat16 (``aten::mkldnn_rnn_layer``: one fused primitive per direction, gates saved in
its workspace for the backward, ``aten::mkldnn_rnn_layer_backward``; a bfloat16 layer's cell state may be
float32), 1.7-3x faster than its own native loop. tandem's
plain-PyTorch kernel (:mod:`tandem.ops.lstm.reference`) reaches the native loop's speed and more, not
oneDNN's: a time step of eager ops cannot match a JIT-compiled fused cell (BENCHMARKS.md, lstm). So where
torch would run oneDNN, tandem.nn.LSTM runs the same primitive, called the way torch calls it, with the
same results bit for bit (a PackedSequence whose sequences are all as long among them, under a torch
that unwraps it, 2.13); everywhere else (other PackedSequences, where torch falls back to its native loop;
proj_size; float64; oneDNN disabled with ``torch.backends.mkldnn.flags(enabled=False)``) tandem's own
kernel runs.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "onednn_applies",
    "lstm_layer_onednn",
    "torch_runs_onednn",
    "torch_runs_onednn_when_packed_uniform",
]

_MODE_LSTM = 2  # cuDNN's RNN mode numbering, which the aten RNN ops share


def onednn_applies(torch_runs: bool) -> bool:
    """Whether tandem.nn.LSTM runs oneDNN's cell for an input torch.nn.LSTM would run it for
    (``torch_runs``: :func:`torch_runs_onednn`): in eager mode, with this torch having the per-layer op."""
    return (
        torch_runs
        and not torch.compiler.is_compiling()  # torch.compile traces tandem's own op (a single node)
        and hasattr(torch.ops.aten, "mkldnn_rnn_layer")
    )


def torch_runs_onednn(x: Tensor, ragged: bool, proj_size: int) -> bool:
    """Whether torch.nn.LSTM itself runs oneDNN's cell for this input, not its native one: ``x`` the rows of a
    padded batch or of a PackedSequence whose sequences are all as long (``ragged`` False: torch runs its
    native loop on other PackedSequences) on the CPU, no projection, oneDNN available and enabled
    (``torch.backends.mkldnn``). What decides, too, which ``c_0`` dtypes it takes and who checks the weights'
    dtypes (tandem.nn.lstm). torch's rule (``use_mkldnn`` in ATen's RNN.cpp): float32, or bfloat16 where the
    CPU computes it natively; float16 only without grad mode on CPUs with float16 arithmetic, which this rule
    leaves to tandem's kernel."""
    return (
        not ragged
        and x.device.type == "cpu"
        and (x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and _ONEDNN_BF16))
        and x.numel() != 0
        and proj_size == 0
        and _ONEDNN_AVAILABLE
        and _onednn_enabled()
    )


def _assume_constant_result(fn):
    """``torch.compiler.assume_constant_result(fn)`` without importing torch._dynamo, which that function
    does (0.8 s of ``import tandem``; a process that runs no op, as ``tandem train``'s launcher, never
    needs it): the marker it sets, which Dynamo reads when it traces a call of ``fn``. A test checks that
    torch's decorator sets no more than this."""
    fn._dynamo_marked_constant = True
    return fn


@_assume_constant_result  # torch.compile cannot trace the query: its value when traced
def _onednn_enabled() -> bool:
    """``torch.backends.mkldnn.enabled`` (``flags(enabled=False)`` turns it off)."""
    return torch._C._get_mkldnn_enabled()


def _packed_uniform_check() -> bool:
    """Whether this torch's LSTM runs oneDNN's cell on a PackedSequence whose sequences are all as long (its
    rows laid out as a padded batch's): torch 2.13 unwraps such a batch and runs its dense path there; torch
    2.11 runs its native loop on every PackedSequence. Asked of torch itself: a one-step packed LSTM, whose
    graph holds oneDNN's backward where torch ran oneDNN."""
    if not _ONEDNN_AVAILABLE:
        return False
    enabled = torch._C._get_mkldnn_enabled()
    try:
        torch._C._set_mkldnn_enabled(True)  # (backends.mkldnn.flags() also sets TF32, with a warning)
        with torch.inference_mode(False), torch.enable_grad():
            # weights of ones, not an nn.LSTM: importing tandem draws nothing from torch's generator
            weights = [torch.ones(4, 1, requires_grad=True) for _ in range(2)]
            weights += [torch.ones(4, requires_grad=True) for _ in range(2)]
            data = torch.ones(1, 1)
            batch_sizes = torch.ones(1, dtype=torch.int64)
            hx = (data[None], data[None])
            out = torch._VF.lstm(data, batch_sizes, hx, weights, True, 1, 0.0, True, False)[0]
    except Exception:  # a torch that cannot run it here: tandem's own kernel for every PackedSequence
        return False
    finally:
        torch._C._set_mkldnn_enabled(enabled)
    seen, todo = set(), [out.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if "mkldnn" in type(node).__name__.lower():
            return True
        todo.extend(n for n, _ in node.next_functions)
    return False


def _bf16_check() -> bool:
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(check is not None and check())


# whether this torch has oneDNN, and whether oneDNN computes bfloat16 on this CPU (torch's
# mkldnn_bf16_device_check): read once, constants to torch.compile, which cannot trace the queries
_ONEDNN_AVAILABLE = torch.backends.mkldnn.is_available()
_ONEDNN_BF16 = _bf16_check()
_ONEDNN_PACKED_UNIFORM = _packed_uniform_check()


def torch_runs_onednn_when_packed_uniform() -> bool:
    """Whether this torch's LSTM runs oneDNN's cell on a PackedSequence whose sequences are all as long, where
    it would on their padded batch (torch 2.13 does; 2.11 runs its native loop on any PackedSequence)."""
    return _ONEDNN_PACKED_UNIFORM


def lstm_layer_onednn(
    x: Tensor,
    batch: int,
    h0: Tensor,
    c0: Tensor,
    weights: list[tuple[Tensor, Tensor, Tensor | None, Tensor | None]],
) -> tuple[Tensor, Tensor, Tensor]:
    """One LSTM layer over ``x`` ``[T*B, I]`` (time-major rows of ``batch`` sequences of equal length)
    with oneDNN; ``weights`` holds ``(w_ih, w_hh, b_ih, b_hh)`` per direction (the module's own
    parameters: autograd reaches them directly). Returns ``(y [T*B, D*H], h_n [D, B, H], c_n [D, B, H])``
    like :func:`tandem.ops.lstm`."""
    steps = x.shape[0] // batch
    # oneDNN's primitive reads x, h0 and c0 as dense arrays whatever their strides: a permuted or sliced
    # one gave wrong numbers and no error. contiguous() costs nothing for the usual contiguous tensors.
    x3 = x.reshape(steps, batch, x.shape[1]).contiguous()
    h0, c0 = h0.contiguous(), c0.contiguous()
    hid = c0.shape[-1]
    # the workspace (the saved gates) is only built when a backward can follow; a trace always builds it
    # (the traced graph may train, and torch.jit.trace's check runs without grad: the same graph)
    train = torch.jit.is_tracing() or (
        torch.is_grad_enabled()
        and any(t is not None and t.requires_grad for t in (x, h0, c0, *(w for ws in weights for w in ws)))
    )
    ys, hs, cs = [], [], []
    for d, (w_ih, w_hh, b_ih, b_hh) in enumerate(weights):
        has_bias = b_ih is not None
        if not has_bias:
            b_ih = b_hh = w_ih.new_zeros(4 * hid)
        y, h_n, c_n, _ = torch.ops.aten.mkldnn_rnn_layer(
            x3, w_ih, w_hh, b_ih, b_hh, h0[d], c0[d], d == 1, [], _MODE_LSTM, hid, 1, has_bias, False, False,
            train,
        )  # fmt: skip
        ys.append(y)
        hs.append(h_n)
        cs.append(c_n)
    y = ys[0] if len(ys) == 1 else torch.cat(ys, -1)
    return y.view(steps * batch, y.shape[-1]), torch.stack(hs), torch.stack(cs)
