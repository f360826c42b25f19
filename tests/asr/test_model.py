"""The DeepSpeech2-shaped model: shapes, independence from batching, and tandem's parts against torch's
(torch.nn.GRU/LSTM and BatchNorm1d with the same weights: the reference we did not write)."""

from __future__ import annotations

import pytest
import torch

from tandem.asr.model import TANDEM_PARTS, TORCH_PARTS, DeepSpeech2, ModelConfig, conv2d_one_channel, dropout

SMALL = dict(n_mels=16, hidden=12, layers=2, conv_channels=4, conv_kernel=(5, 5))


def _inputs(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    frames = torch.tensor([37, 50, 9, 23])
    features = torch.randn(4, 50, 16, generator=g, dtype=dtype)
    features = features * (torch.arange(50)[None, :, None] < frames[:, None, None])
    return features, frames


def test_shapes_and_frames():
    model = DeepSpeech2(ModelConfig(**SMALL))
    log_probs, out_frames = model(*_inputs())
    assert log_probs.shape == (13, 4, 29) and out_frames.tolist() == [10, 13, 3, 6]
    assert torch.allclose(log_probs.exp().sum(-1)[0], torch.ones(4))
    assert torch.equal(ModelConfig(**SMALL).output_frames(torch.tensor([37, 50, 9, 23])), out_frames)


@pytest.mark.parametrize("cell", ["gru", "lstm"])
def test_an_utterance_gives_the_same_output_alone_and_in_a_batch(cell):
    model = DeepSpeech2(ModelConfig(**SMALL, cell=cell))
    features, frames = _inputs()
    model.train()
    model(features, frames)  # running statistics that are not the initial ones
    model.eval()
    with torch.no_grad():
        batch, out_frames = model(features, frames)
        for b in range(4):
            n = int(frames[b])
            alone, m = model(features[b : b + 1, :n], frames[b : b + 1])
            assert m[0] == out_frames[b]
            torch.testing.assert_close(alone[: int(m[0]), 0], batch[: int(m[0]), b], rtol=0, atol=1e-5)


@pytest.mark.parametrize("cell", ["gru", "lstm"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_tandem_parts_equal_torch_parts(cell, training):
    """The same network from torch.nn.GRU/LSTM and BatchNorm1d, weights copied: outputs, gradients and
    running statistics agree (float64: only summation order differs)."""
    config = ModelConfig(**SMALL, cell=cell)
    ours = DeepSpeech2(config, TANDEM_PARTS).double()
    theirs = DeepSpeech2(config, TORCH_PARTS).double()
    theirs.load_state_dict(ours.state_dict())
    ours.train(training)
    theirs.train(training)
    features, frames = _inputs(torch.float64)
    x1, x2 = features.clone().requires_grad_(), features.clone().requires_grad_()
    torch.manual_seed(7)  # the same dropout masks for both
    out1, f1 = ours(x1, frames)
    torch.manual_seed(7)
    out2, f2 = theirs(x2, frames)
    assert torch.equal(f1, f2)
    torch.testing.assert_close(out1, out2, rtol=1e-10, atol=1e-10)
    weights = torch.randn(out1.shape, dtype=torch.float64)
    (out1 * weights).sum().backward()
    (out2 * weights).sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-9, atol=1e-10)
    for (name, p1), p2 in zip(ours.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(p1.grad, p2.grad, rtol=1e-9, atol=1e-10, msg=name)
    for (name, b1), b2 in zip(ours.named_buffers(), theirs.buffers()):
        torch.testing.assert_close(b1, b2, rtol=1e-12, atol=1e-12, msg=name)


def test_state_dicts_load_both_ways():
    ours, theirs = DeepSpeech2(ModelConfig(**SMALL)), DeepSpeech2(ModelConfig(**SMALL), TORCH_PARTS)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    ours.load_state_dict(theirs.state_dict())
    theirs.load_state_dict(ours.state_dict())


def test_config_errors():
    with pytest.raises(ValueError, match="expected cell 'gru' or 'lstm', got 'rnn'"):
        ModelConfig(cell="rnn")
    with pytest.raises(ValueError, match="conv_layers 1 or 2, got 3"):
        ModelConfig(conv_layers=3)


@pytest.mark.parametrize(
    "kernel, stride, padding, size",
    [
        ((11, 5), (2, 2), (5, 2), (40, 37)),
        ((3, 4), (1, 3), (0, 1), (9, 20)),
        ((5, 5), (2, 1), (2, 2), (7, 6)),
    ],
)
@pytest.mark.parametrize("bias", [True, False])
def test_one_channel_conv_equals_torch(kernel, stride, padding, size, bias):
    """Values and all three gradients of torch.nn.Conv2d's (float64), with the strides that make the
    last rows and columns of the padded input unused."""
    conv = torch.nn.Conv2d(1, 6, kernel, stride, padding, bias=bias).double()
    x = torch.randn(3, 1, *size, dtype=torch.float64, requires_grad=True)
    ours = conv2d_one_channel(x, conv)
    theirs = conv(x)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
    grad = torch.randn_like(theirs)
    params = [x, *conv.parameters()]
    for a, b in zip(torch.autograd.grad(ours, params, grad), torch.autograd.grad(theirs, params, grad)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    # features need no gradient: the weight's alone, the same
    (ours_w,) = torch.autograd.grad(conv2d_one_channel(x.detach(), conv), [conv.weight], grad)
    (theirs_w,) = torch.autograd.grad(conv(x.detach()), [conv.weight], grad)
    torch.testing.assert_close(ours_w, theirs_w, rtol=1e-10, atol=1e-10)


def test_one_channel_conv_leaves_other_convolutions_to_torch():
    conv = torch.nn.Conv2d(2, 3, 3, padding="same")
    x = torch.randn(1, 2, 5, 5)
    assert torch.equal(conv2d_one_channel(x, conv), conv(x))


def test_dropout_keeps_torchs_distribution():
    x = torch.ones(400, 500)
    torch.manual_seed(0)
    out = dropout(x, 0.25, True)
    kept = out != 0
    assert abs(kept.float().mean().item() - 0.75) < 0.005  # 200000 draws: 5 standard deviations
    torch.testing.assert_close(out[kept], torch.full_like(out[kept], 1 / 0.75))
    assert dropout(x, 0.25, False) is x and dropout(x, 0.0, True) is x
    assert torch.equal(dropout(x, 1.0, True), torch.zeros_like(x))  # as F.dropout, not nan
    with pytest.raises(ValueError, match="dropout: expected p between 0 and 1, got 1.5"):
        dropout(x, 1.5, True)
    x = torch.randn(30, 40, requires_grad=True)
    torch.manual_seed(1)
    out = dropout(x, 0.5, True)
    out.sum().backward()
    torch.testing.assert_close(x.grad, (out != 0).float() * 2.0)
