"""tandem.models.SpeechClassifier (``tandem train --task classify``) against the same network built from
torch's parts and run on each utterance alone: padding never enters its statistics, recurrence or pooling."""

from __future__ import annotations

import pytest
import torch

from tandem.models import SpeechClassifier


def _torch_twin(model: SpeechClassifier, cell: str) -> tuple[torch.nn.Module, ...]:
    """torch.nn.BatchNorm1d, torch.nn.GRU/LSTM and Linear holding ``model``'s weights and statistics."""
    norm = torch.nn.BatchNorm1d(model.norm.num_features).double()
    norm.load_state_dict(model.norm.state_dict())
    rnn_cls = torch.nn.GRU if cell == "gru" else torch.nn.LSTM
    rnn = rnn_cls(model.rnn.input_size, model.rnn.hidden_size, model.rnn.num_layers, bidirectional=True)
    rnn = rnn.double()
    rnn.load_state_dict(model.rnn.state_dict())
    head = torch.nn.Linear(model.head.in_features, model.head.out_features).double()
    head.load_state_dict(model.head.state_dict())
    return norm, rnn, head


@pytest.mark.parametrize("cell", ["gru", "lstm"])
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_logits_are_each_utterances_own_as_torchs_parts_compute_them(cell, training):
    """Each utterance run alone through torch's RNN (no padding at all), pooled over its own frames; the
    batch norm over the real frames of the whole batch (training) or with the running statistics (eval)."""
    torch.manual_seed(0)
    model = SpeechClassifier(num_features=5, num_classes=4, hidden=6, layers=2, cell=cell).double()
    with torch.no_grad():  # running statistics that are not the identity
        model.norm.running_mean.uniform_(-1, 1)
        model.norm.running_var.uniform_(0.5, 2)
    model.train(training)
    lengths = torch.tensor([9, 3, 6, 1])
    features = torch.randn(4, 9, 5, dtype=torch.float64)
    for i, n in enumerate(lengths.tolist()):
        features[i, n:] = 1e3  # padding that would show if it were read
    norm, rnn, head = _torch_twin(model, cell)
    norm.train(training)
    got = model(features, lengths)

    real = torch.cat([features[i, :n] for i, n in enumerate(lengths.tolist())])
    normed = norm(real).split(lengths.tolist())
    expected = []
    for x in normed:
        out, _ = rnn(x.unsqueeze(1))  # [T, 1, 2H], one utterance, no padding
        out = out.squeeze(1)
        expected.append(head(torch.cat([out.mean(0), out.amax(0)])))
    torch.testing.assert_close(got, torch.stack(expected))
    if training:  # the statistics moved as torch's over the same real frames
        torch.testing.assert_close(model.norm.running_mean, norm.running_mean)
        torch.testing.assert_close(model.norm.running_var, norm.running_var)


def test_an_utterances_logits_do_not_depend_on_what_it_is_batched_with():
    torch.manual_seed(0)
    model = SpeechClassifier(num_features=5, num_classes=4, hidden=6, layers=1).double().eval()
    short = torch.randn(1, 4, 5, dtype=torch.float64)
    alone = model(short, torch.tensor([4]))
    batch = torch.randn(2, 11, 5, dtype=torch.float64)
    batch[1, :4] = short[0]
    together = model(batch, torch.tensor([11, 4]))
    torch.testing.assert_close(together[1:], alone, rtol=1e-12, atol=1e-12)
