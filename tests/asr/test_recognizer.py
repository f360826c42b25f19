"""The Recognizer's contract: its transcripts are greedy CTC decoding of the checkpoint's model run on
LogMel features of the same audio (computed here directly, one utterance at a time), whatever the
batching, the input rate or the channel count (with fit_edges=False; the default's cuts and padding
of the edges, tested with a stand-in model, run the same decoding on the audio they make); ``to_torch``
is the same network from torch.nn modules; a checkpoint that is not a recognizer is refused, naming the
file."""

from __future__ import annotations

import io
from functools import lru_cache

import numpy as np
import pytest
import torch

import tandem
from tandem.asr import (
    ENGLISH,
    Alphabet,
    AudioError,
    ConnectedDigits,
    DeepSpeech2,
    FeatureConfig,
    LogMel,
    ModelConfig,
    Recognizer,
    greedy_decode,
    load_spoken_digits,
    split_recordings,
)
from tandem.asr.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from tandem.asr.features import resample

sf = pytest.importorskip("soundfile")
scipy_signal = pytest.importorskip("scipy.signal")

SMALL = dict(hidden=32, layers=2, conv_channels=8)


@lru_cache(maxsize=1)
def _utterances() -> tuple[torch.Tensor, ...]:
    """Eight connected-digit test utterances (8 kHz, 0.5 to 4 s), real recorded speech."""
    recordings = load_spoken_digits()
    _, test = split_recordings(recordings)
    digits = ConnectedDigits(recordings, test)
    return tuple(digits.render(u) for u in digits.plan(seed=0)[:8])


def _model(cell: str = "gru", seed: int = 5) -> DeepSpeech2:
    """An untrained model whose outputs vary from frame to frame (a fresh one says one letter
    throughout): its batch norms hold statistics of real features, not the initial 0 and 1, and its
    output layer's weights are ten times their initial size."""
    torch.manual_seed(seed)
    model = DeepSpeech2(ModelConfig(**SMALL, cell=cell))
    audio = list(_utterances())
    waveforms = torch.nn.utils.rnn.pad_sequence(audio, batch_first=True)
    with torch.no_grad():
        model.train()(*LogMel()(waveforms, torch.tensor([len(a) for a in audio])))
        model.head.weight.mul_(10.0)
    return model.eval()


def _state(model: DeepSpeech2) -> dict:
    return {
        "model_config": model.config.to_dict(),
        "feature_config": FeatureConfig().to_dict(),
        "alphabet": ENGLISH.characters,
        "model": model.state_dict(),
    }


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("recognizer") / "checkpoint.pt"
    save_checkpoint(_state(_model()), path)
    return path


def _direct(path, audio: list[torch.Tensor]) -> list[str]:
    """What the checkpoint's model says about 8 kHz mono ``audio``, one utterance at a time, built here
    from the checkpoint's parts without the Recognizer."""
    state = load_checkpoint(path)
    model = DeepSpeech2(ModelConfig(**state["model_config"]))
    model.load_state_dict(state["model"])
    model.eval()
    logmel, alphabet = LogMel(FeatureConfig(**state["feature_config"])), Alphabet(state["alphabet"])
    texts = []
    with torch.no_grad():
        for a in audio:
            log_probs, frames = model(*logmel(a[None], torch.tensor([len(a)])))
            texts += greedy_decode(log_probs, frames, alphabet)
    return texts


def test_transcripts_are_the_models_greedy_decoding_of_logmel(checkpoint):
    audio = list(_utterances())
    expected = _direct(checkpoint, audio)
    # not a vacuous comparison: transcripts that differ, each one where every frame counts
    assert len(set(expected)) >= 6 and all(expected) and len(set("".join(expected))) >= 3, expected
    rec = Recognizer.from_checkpoint(checkpoint, fit_edges=False)
    assert rec.sample_rate == 8000 and not rec.model.training
    assert [rec.transcribe(a, 8000) for a in audio] == expected
    assert [rec.transcribe(a.numpy().astype(np.float64), 8000) for a in audio[:2]] == expected[:2]
    assert rec.transcribe_batch(audio, 8000) == expected
    # two identical channels are the mono recording
    assert [rec.transcribe(torch.stack([a, a]), 8000) for a in audio[:3]] == expected[:3]


def test_a_checkpoint_from_before_normalize_computes_the_features_it_was_trained_on(tmp_path, checkpoint):
    """Checkpoints made before FeatureConfig.normalize existed name no normalisation: their models were
    trained on each band divided by its own standard deviation ("band"), not on the new default's."""
    state = torch.load(checkpoint, weights_only=True)
    assert state["feature_config"]["normalize"] == "utterance"
    old = {k: v for k, v in state["feature_config"].items() if k != "normalize"}
    path = tmp_path / "old.pt"
    torch.save({**state, "feature_config": old}, path)
    rec = Recognizer.from_checkpoint(path, fit_edges=False)
    assert rec.features == FeatureConfig(normalize="band")
    band = tmp_path / "band.pt"
    torch.save({**state, "feature_config": {**old, "normalize": "band"}}, band)
    audio = list(_utterances())
    expected = _direct(band, audio)
    assert [rec.transcribe(a, 8000) for a in audio] == expected
    assert expected != _direct(checkpoint, audio)  # the two normalisations tell apart here


@pytest.mark.parametrize("rate", [16000, 44100])
def test_other_rates_are_resampled_to_the_models(checkpoint, rate):
    """Audio brought to ``rate`` by scipy: the transcript of what tandem's resampler makes of it at the
    model's 8 kHz."""
    audio = list(_utterances())
    g = np.gcd(rate, 8000)
    high = [torch.from_numpy(scipy_signal.resample_poly(a.numpy(), rate // g, 8000 // g)) for a in audio]
    rec = Recognizer.from_checkpoint(checkpoint, fit_edges=False)
    got = rec.transcribe_batch(high, rate)
    assert got == _direct(checkpoint, [tandem.asr.resample(h.float(), rate, 8000) for h in high])
    assert rec.transcribe(high[0].numpy(), rate) == got[0]


def test_batching_does_not_change_the_transcripts(checkpoint):
    audio = list(_utterances())
    rates = [8000, 16000] * 4
    mixed = [a if r == 8000 else tandem.asr.resample(a, 8000, 16000) for a, r in zip(audio, rates)]
    rec = Recognizer.from_checkpoint(checkpoint)
    one_by_one = [rec.transcribe(m, r) for m, r in zip(mixed, rates)]
    for batch_size in (1, 3, 8, 64):
        assert rec.transcribe_batch(mixed, rates, batch_size=batch_size) == one_by_one


def test_a_long_recording_is_not_batched_with_short_ones(checkpoint, monkeypatch):
    """A batch pads to its longest recording: one long recording among short ones forms a batch of its
    own (peak memory of one long recording, not of batch_size of them), the transcripts unchanged."""
    from tandem.asr import recognizer

    assert list(recognizer._batches([0, 1, 2, 3], [100, 10, 10, 10], 16)) == [[0, 1, 2, 3]]
    monkeypatch.setattr(recognizer, "PADDED_SAMPLES", 120)
    assert list(recognizer._batches([0, 1, 2, 3], [100, 10, 10, 10], 16)) == [[0], [1, 2, 3]]
    assert list(recognizer._batches([0, 1, 2, 3], [100, 10, 10, 10], 2)) == [[0], [1, 2], [3]]
    audio = list(_utterances())
    rec = Recognizer.from_checkpoint(checkpoint)
    expected = rec.transcribe_batch(audio, 8000, batch_size=1)
    monkeypatch.setattr(recognizer, "PADDED_SAMPLES", 2 * max(len(a) for a in audio))
    assert rec.transcribe_batch(audio, 8000, batch_size=16) == expected


def test_transcribe_batch_errors_name_the_waveform(checkpoint):
    rec = Recognizer.from_checkpoint(checkpoint)
    audio = list(_utterances())[:2]
    with pytest.raises(AudioError, match=r"^waveforms\[1\]: silent recording"):
        rec.transcribe_batch([audio[0], torch.zeros(4000)], 8000)
    with pytest.raises(AudioError, match=r"^waveform: empty recording"):
        rec.transcribe(np.zeros(0), 8000)
    with pytest.raises(ValueError, match="expected one sample_rate or 2 .one per waveform., got 3"):
        rec.transcribe_batch(audio, [8000, 8000, 8000])
    for bad in (0, 2.5, True, np.bool_(True), np.float64(2.0), np.int64(-1)):
        with pytest.raises(ValueError, match="expected a positive integer batch_size"):
            rec.transcribe_batch(audio, 8000, batch_size=bad)
    # an integer of any type, as the sample rates (a numpy one was refused)
    expected = rec.transcribe_batch(audio, 8000, batch_size=1)
    assert rec.transcribe_batch(audio, 8000, batch_size=np.int64(1)) == expected
    # a generator had "object of type 'generator' has no len()", a dict torch's "invalid data type 'str'"
    for bad in ((a for a in audio), {"a": audio[0]}):
        with pytest.raises(
            TypeError, match=r"^waveforms: expected a sequence of recordings .*, got (generator|dict)"
        ):
            rec.transcribe_batch(bad, 8000)


@pytest.mark.parametrize("cell", ["gru", "lstm"])
def test_to_torch_is_the_same_network_from_torch_modules(cell):
    rec = Recognizer(_model(cell), FeatureConfig(), ENGLISH, fit_edges=False)
    net = rec.to_torch()
    rnn = {"gru": torch.nn.GRU, "lstm": torch.nn.LSTM}[cell]
    assert all(type(m) is rnn for m in net.rnns) and all(
        type(m) is torch.nn.BatchNorm1d for m in net.rnn_norms
    )
    assert not any(type(m).__module__.startswith("tandem.nn") for m in net.modules())
    assert not net.training and all(not m.training for m in net.modules())
    audio = list(_utterances())
    waveforms = torch.nn.utils.rnn.pad_sequence(audio, batch_first=True)
    features, frames = LogMel()(waveforms, torch.tensor([len(a) for a in audio]))
    with torch.no_grad():
        ours, ours_frames = rec.model(features, frames)
        theirs, theirs_frames = net(features, frames)
    assert torch.equal(ours_frames, theirs_frames)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    assert greedy_decode(theirs, theirs_frames, ENGLISH) == rec.transcribe_batch(audio, 8000)


def _write(path, data: np.ndarray, rate: int, subtype: str):
    sf.write(path, data, rate, subtype=subtype)
    return path


def test_transcribe_files_in_order_with_errors_in_place(tmp_path, checkpoint):
    audio = list(_utterances())[:3]
    rec = Recognizer.from_checkpoint(checkpoint)
    expected = rec.transcribe_batch(audio, 8000)
    stereo = scipy_signal.resample_poly(audio[1].numpy(), 441, 80)
    files = [
        _write(tmp_path / "a.wav", audio[0].numpy(), 8000, "FLOAT"),
        tmp_path / "missing.wav",
        _write(tmp_path / "b.wav", np.stack([stereo, stereo], 1), 44100, "FLOAT"),
        _write(tmp_path / "silent.wav", np.zeros(800), 8000, "PCM_16"),
        str(_write(tmp_path / "c.wav", audio[2].numpy(), 8000, "PCM_24")),
    ]
    stream = io.BytesIO((tmp_path / "a.wav").read_bytes())
    for batch_size in (1, 2, 16):
        results = rec.transcribe_files([*files, stream], batch_size=batch_size)
        stream.seek(0)
        assert [r.source for r in results] == [str(f) for f in files] + ["<stream>"]
        assert [r.text for r in results] == [
            expected[0], None, rec.transcribe(np.stack([stereo, stereo]), 44100), None, results[4].text,
            expected[0],
        ]  # fmt: skip
        assert results[4].text == rec.transcribe(sf.read(files[4], dtype="float32")[0], 8000)
        assert results[1].error == f"{files[1]}: no such file"
        assert results[3].error.startswith(f"{files[3]}: silent recording")
        assert [round(r.audio_seconds, 6) for r in results] == [
            round(len(audio[0]) / 8000, 6), 0.0, round(len(stereo) / 44100, 6), 0.0,
            round(len(audio[2]) / 8000, 6), round(len(audio[0]) / 8000, 6),
        ]  # fmt: skip
        assert all(r.seconds > 0 for r in results if r.error is None)


def test_a_file_that_fails_otherwise_is_its_own_error(tmp_path, checkpoint, monkeypatch):
    """More channels than an array may have (a file carries its layout), and a failure that is no
    AudioError (here a resampler out of memory): that file's error, the others transcribed."""
    from tandem.asr import audio as audio_module

    clip = list(_utterances())[0].numpy()
    rec = Recognizer.from_checkpoint(checkpoint)
    many = _write(tmp_path / "ch65.wav", np.repeat(clip[:, None], 65, axis=1), 8000, "FLOAT")
    odd = _write(tmp_path / "odd.wav", scipy_signal.resample_poly(clip, 2, 1), 16000, "FLOAT")
    plain = _write(tmp_path / "plain.wav", clip, 8000, "FLOAT")
    results = rec.transcribe_files([many, plain])
    assert [r.text for r in results] == [rec.transcribe(clip, 8000)] * 2

    expected = rec.transcribe(clip, 8000)
    resample = audio_module.resample

    def out_of_memory(waveform, orig_freq, new_freq, **kwargs):
        if orig_freq == 16000:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 64 GB")
        return resample(waveform, orig_freq, new_freq, **kwargs)

    monkeypatch.setattr(audio_module, "resample", out_of_memory)
    results = rec.transcribe_files([plain, odd, plain])
    assert [r.text for r in results] == [expected, None, expected]
    assert results[1].error.startswith(f"{odd}: cannot transcribe (RuntimeError: DefaultCPUAllocator")


def test_a_file_the_model_fails_on_is_its_own_error(tmp_path, checkpoint, monkeypatch):
    """A failure past the reading (the model out of memory on one long recording): a traceback, and every
    file of the run lost, the ones transcribed before it too; now that file's error, the others
    transcribed as alone, in batches with it or not."""
    clips = [u.numpy() for u in list(_utterances())[:2]]
    rec = Recognizer.from_checkpoint(checkpoint)
    expected = [rec.transcribe(c, 8000) for c in clips]
    short = [_write(tmp_path / f"{k}.wav", c, 8000, "FLOAT") for k, c in enumerate(clips)]
    long = _write(tmp_path / "long.wav", np.tile(clips[0], 8), 8000, "FLOAT")
    limit = 4 * max(len(c) for c in clips)
    forward = type(rec.model).forward

    def out_of_memory(model, features, frames):
        if int(frames.max()) * rec.features.hop_length > limit:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 64 GB")
        return forward(model, features, frames)

    monkeypatch.setattr(type(rec.model), "forward", out_of_memory)
    for batch_size in (1, 3):
        results = rec.transcribe_files([short[0], long, short[1]], batch_size=batch_size)
        assert [r.text for r in results] == [expected[0], None, expected[1]]
        assert results[1].error.startswith(f"{long}: cannot transcribe (RuntimeError: DefaultCPUAllocator")
        assert [r.audio_seconds for r in results[::2]] == [len(c) / 8000 for c in clips]


def test_arguments_of_the_wrong_kind_are_named_with_what_came(tmp_path, checkpoint):
    """A path, bytes or None given as samples raised torch's "new(): invalid data type 'str'" or "Could not
    infer dtype of PosixPath" (no argument, no batch index); a set or dict of files, "'set' object is not
    subscriptable"; an entry of files that is samples was named "None"; a state_dict as the model an
    AttributeError about .config; a bad batch_size of iter_transcribe_files raised only at the first item."""
    clip = list(_utterances())[0].numpy()
    rec = Recognizer.from_checkpoint(checkpoint)
    path = _write(tmp_path / "a.wav", clip, 8000, "FLOAT")
    for given, kind in (
        (str(path), "str"),
        (path, "PosixPath"),
        (path.read_bytes(), "bytes"),
        (None, "NoneType"),
    ):
        with pytest.raises(
            TypeError, match=f"^waveform: expected samples, a tensor or numpy array, got {kind}"
        ):
            rec.transcribe(given, 8000)
    with pytest.raises(TypeError, match="^waveforms\\[1\\]: expected samples, .* got NoneType"):
        rec.transcribe_batch([clip, None], 8000)

    class Indexed:  # items by index, but no length
        def __getitem__(self, i):
            return str(path)

    for files in ({str(path)}, {str(path): 1}, torch.from_numpy(clip), Indexed()):
        with pytest.raises(TypeError, match=f"^files: expected a sequence of .* got {type(files).__name__}"):
            rec.transcribe_files(files)
    import collections

    same = [rec.transcribe_files(kind([path, str(path)])) for kind in (np.array, collections.deque)]
    assert [[r.text for r in results] for results in same] == [[rec.transcribe(clip, 8000)] * 2] * 2
    results = rec.transcribe_files([torch.from_numpy(clip), path])
    assert results[0].error == (
        "files[0]: expected a path, a binary file object or a file's bytes, got Tensor "
        "(samples: transcribe_batch)"
    )
    assert results[1].text == rec.transcribe(clip, 8000)
    with pytest.raises(ValueError, match="batch_size"):
        rec.iter_transcribe_files([path], batch_size=0)  # at the call, not at the first item
    with pytest.raises(TypeError, match="^Recognizer: expected model a DeepSpeech2, got OrderedDict"):
        Recognizer(rec.model.state_dict(), rec.features, rec.alphabet)
    with pytest.raises(ValueError) as info:
        Recognizer.from_checkpoint(checkpoint, device=None)
    assert "\n" not in str(info.value) and "got None" in str(info.value)
    assert Recognizer.from_checkpoint(str(checkpoint).encode()).transcribe(clip, 8000) == results[1].text


def test_arguments_taken_as_a_python_user_passes_them(tmp_path, checkpoint):
    """One path where a list belongs is refused (it would be read character by character); a rate of any
    numeric kind serves every waveform of a batch."""
    clip = list(_utterances())[0].numpy()
    rec = Recognizer.from_checkpoint(checkpoint)
    path = str(_write(tmp_path / "a.wav", clip, 8000, "FLOAT"))
    with pytest.raises(TypeError, match="files: expected a sequence of paths.*got str"):
        rec.transcribe_files(path)
    expected = rec.transcribe_batch([clip, clip], 8000)
    for rate in (np.int64(8000), 8000.0, torch.tensor(8000)):
        assert rec.transcribe_batch([clip, clip], rate) == expected


def test_another_default_device_transcribes_as_the_cpu(checkpoint):
    """Under ``torch.set_default_device`` (or the ``torch.device`` context; "meta" stands in for a GPU)
    from_checkpoint(device="cpu") built its model and features on the default device, and transcribing
    CPU samples (a tensor, a numpy array, resampled from 16 kHz and from 44.101 kHz) made them there:
    the same text as without, edges fitted (seeded noise padding) or not."""
    clips = list(_utterances())[:2]
    other_rates = [(resample(clips[0], 8000, rate).numpy(), rate) for rate in (16000, 44101)]
    for fit_edges in (True, False):
        rec = Recognizer.from_checkpoint(checkpoint, fit_edges=fit_edges)
        expected = rec.transcribe_batch(clips, 8000), [rec.transcribe(*clip) for clip in other_rates]
        with torch.device("meta"):
            rec = Recognizer.from_checkpoint(checkpoint, device="cpu", fit_edges=fit_edges)
            got = rec.transcribe_batch(clips, 8000), [rec.transcribe(*clip) for clip in other_rates]
        assert next(rec.model.parameters()).device.type == "cpu" and rec.logmel.fbank.device.type == "cpu"
        assert got == expected


def test_a_float64_default_dtype_transcribes_as_float32(checkpoint):
    """Under ``torch.set_default_dtype(torch.float64)`` from_checkpoint built float64 layers and fed them
    float32 features (conv2d's dtype error); a model converted by hand (``.double()``) is fed its dtype."""
    clips = list(_utterances())[:3]
    expected = Recognizer.from_checkpoint(checkpoint, fit_edges=False).transcribe_batch(clips, 8000)
    saved = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        rec = Recognizer.from_checkpoint(checkpoint, fit_edges=False)
        assert next(rec.model.parameters()).dtype == torch.float32
        assert rec.transcribe_batch(clips, 8000) == expected
    finally:
        torch.set_default_dtype(saved)
    rec.model.double()
    assert rec.transcribe_batch(clips, 8000) == expected


@pytest.mark.parametrize(
    "bad",
    [{"alphabet": "_ 'abcdefghijklmnopqrstuvwxyz"}, {"features": {}}, {"fit_edges": 1}],
    ids=["alphabet-str", "features-dict", "fit_edges-int"],
)
def test_constructor_arguments_of_another_type_are_refused_before_any_change(bad):
    """A str alphabet was taken (then ``transcribe`` failed on ``.characters``), a dict of features an
    AttributeError; the model was put in eval mode before fit_edges was refused."""
    model = _model().train()
    kwargs = dict(model=model, features=FeatureConfig(), alphabet=ENGLISH) | bad
    name = next(iter(bad))
    with pytest.raises(TypeError, match=f"Recognizer: expected {name}"):
        Recognizer(**kwargs)
    assert model.training


def _classify_checkpoint(path):
    """What ``tandem train --task classify`` writes (src/tandem/cli/_train_worker.py)."""
    model = torch.nn.Linear(12, 9)
    state = {"model": model.state_dict(), "optimizer": {}, "epoch": 3, "history": [], "train_seconds": 1.0}
    torch.save({**state, "config": {"task": "classify", "hidden": 64}}, path)


@pytest.mark.parametrize(
    "case, expected",
    [
        ("missing", "no such file"),
        ("directory", "a directory, not a checkpoint file (tandem train writes checkpoint.pt in it)"),
        ("truncated", "not a readable checkpoint (truncated or corrupt?)"),
        ("text", "not a readable checkpoint (truncated or corrupt?)"),
        ("classify", "not a speech-recognizer checkpoint"),
        ("newer", "checkpoint version 2, this tandem reads version 1"),
        ("other-weights", "does not make a recognizer"),
        ("other-alphabet", "does not make a recognizer"),
        ("bad-config", "does not make a recognizer"),
        ("no-hop", "does not make a recognizer: FeatureConfig: expected hop_ms in milliseconds, above 0"),
        ("no-rate", "does not make a recognizer: FeatureConfig: expected sample_rate a positive integer"),
        ("bad-normalize", "does not make a recognizer: FeatureConfig: expected normalize one of 'utterance'"),
    ],
)
def test_checkpoints_that_are_not_recognizers_are_refused_naming_the_file(
    tmp_path, checkpoint, case, expected
):
    path = tmp_path / f"{case}.pt"
    state = torch.load(checkpoint, weights_only=True)
    if case == "directory":
        path.mkdir()
    elif case == "truncated":
        data = checkpoint.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif case == "text":
        path.write_text("hello\n")
    elif case == "classify":
        _classify_checkpoint(path)
    elif case == "newer":
        torch.save({**state, "version": 2}, path)
    elif case == "other-weights":
        torch.save({**state, "model_config": {**state["model_config"], "hidden": 48}}, path)
    elif case == "other-alphabet":
        torch.save({**state, "alphabet": "abc"}, path)
    elif case == "bad-config":
        torch.save({**state, "model_config": {**state["model_config"], "cell": "rnn"}}, path)
    elif case in ("no-hop", "no-rate", "bad-normalize"):  # no-hop, no-rate: a ZeroDivisionError later
        setting = {
            "no-hop": {"hop_ms": 0.0}, "no-rate": {"sample_rate": 0}, "bad-normalize": {"normalize": 1}
        }[case]  # fmt: skip
        torch.save({**state, "feature_config": {**state["feature_config"], **setting}}, path)
    with pytest.raises(CheckpointError) as info:
        Recognizer.from_checkpoint(path)
    message = str(info.value)
    assert message.startswith(f"{path}: ") and expected in message and "\n" not in message
    if case == "classify":
        assert "--task classify" in message


def test_weights_that_do_not_fit_are_named_with_the_settings_the_config_lacks(tmp_path, checkpoint):
    """The message kept torch's first line, "Error(s) in loading state_dict for DeepSpeech2:", naming no
    weight: it names those missing, unexpected and of another shape (a few, then how many more), and the
    settings a model_config lacks, whose defaults made the weights not fit."""
    state = torch.load(checkpoint, weights_only=True)
    weights = {k: v for k, v in state["model"].items() if k != "head.weight"}
    extra = {f"extra.{i}": torch.zeros(1) for i in range(6)}
    config = {k: v for k, v in state["model_config"].items() if k != "hidden"}
    fits = "does not make a recognizer: its weights do not fit the model its model_config describes: "
    cases = {
        "missing": ({"model": weights}, fits + "missing head.weight"),
        "unexpected": (
            {"model": {**state["model"], **extra}},
            "unexpected extra.0, extra.1, extra.2, extra.3 and 2 more",
        ),
        "both": ({"model": {**weights, **extra}}, fits + "missing head.weight; unexpected extra.0"),
        "config": (
            {"model_config": config},
            f"of another shape rnns.0.weight_ih_l0 [{3 * SMALL['hidden']}, ",
        ),
    }
    for case, (changed, expected) in cases.items():
        path = tmp_path / f"{case}.pt"
        torch.save({**state, **changed}, path)
        with pytest.raises(CheckpointError) as info:
            Recognizer.from_checkpoint(path)
        message = str(info.value)
        assert message.startswith(f"{path}: ") and expected in message and "\n" not in message, message
    assert " more (its model_config lacks 'hidden': the defaults hidden=128 were taken)" in message, message


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is there")
def test_cuda_without_cuda_is_a_clear_error(checkpoint):
    with pytest.raises(ValueError, match="device 'cuda' was asked for, but CUDA is not available"):
        Recognizer.from_checkpoint(checkpoint, device="cuda")
    assert Recognizer.from_checkpoint(checkpoint, device="auto").device == torch.device("cpu")


@pytest.mark.parametrize(
    "device",
    [
        "mps",
        "meta",
        "nonsense",
        pytest.param(7, marks=pytest.mark.skipif(torch.cuda.is_available(), reason="an index is CUDA's")),
    ],
    ids=str,
)
def test_a_device_the_recognizer_cannot_run_on_is_a_value_error_naming_it(checkpoint, device):
    """As documented: a ValueError naming the device (an 'mps' or an index raised torch's RuntimeError, and
    'meta' was taken, to fail deep in torch at the first recording)."""
    with pytest.raises(
        ValueError, match=f"expected device 'auto', 'cpu', 'cuda' or 'cuda:N', got '?{device}"
    ):
        Recognizer.from_checkpoint(checkpoint, device=device)


class _SaysLoud(torch.nn.Module):
    """A stand-in for the acoustic model: 'a' at output frames whose input frames are loud (mean feature
    above 0: the features are normalised per utterance, the quiet below its mean, a burst above), the blank
    elsewhere. Records the input frames of every utterance it is given (``calls``), and of every batch."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config, self.calls, self.batches = config, [], []
        self.anchor = torch.nn.Parameter(torch.zeros(()))  # a device to be on

    def forward(self, features: torch.Tensor, frames: torch.Tensor):
        self.calls += frames.tolist()
        self.batches.append(frames.tolist())
        stride = int(np.prod(self.config.conv_time_strides))
        out = self.config.output_frames(frames)
        loud = features.mean(-1) > 0.0  # [B, T]
        loud = torch.nn.functional.pad(loud, (0, int(out.max()) * stride - loud.shape[1]))
        loud = loud.view(len(frames), -1, stride).any(-1).T  # [T', B]
        scores = torch.zeros(*loud.shape, len(ENGLISH))
        scores[..., 0] = 1.0
        scores[..., ENGLISH.encode("a")[0]] = 2.0 * loud
        return scores, out


def _burst(before_s: float, after_s: float, seed: int = 0) -> torch.Tensor:
    """Low noise, 0.4 s of loud noise after ``before_s`` seconds, ``after_s`` seconds of low noise."""
    g = torch.Generator().manual_seed(seed)
    quiet = lambda s: 1e-3 * torch.randn(round(s * 8000), generator=g)  # noqa: E731
    return torch.cat([quiet(before_s), 0.3 * torch.randn(3200, generator=g), quiet(after_s)])


def test_long_silence_at_the_edges_is_cut_and_the_rest_transcribed_again(checkpoint):
    """The cut is EDGE_KEPT_MS around the first and last non-blank output frames (an output frame is
    hop * 4 = 320 samples; the last one's input ends a window after its last hop starts), redone while it
    removes at least MIN_CUT_MS; fit_edges=False is one pass over the recording as it is."""
    from tandem.asr import recognizer

    assert recognizer.EDGE_KEPT_MS == (250.0, 500.0) and recognizer.MIN_CUT_MS == 100.0
    rec = Recognizer.from_checkpoint(checkpoint)
    assert rec.fit_edges and not Recognizer.from_checkpoint(checkpoint, fit_edges=False).fit_edges
    for bad in ("no", None, 0):
        with pytest.raises(TypeError, match=r"^Recognizer: expected fit_edges True or False, got "):
            Recognizer.from_checkpoint(checkpoint, fit_edges=bad)
        with pytest.raises(TypeError, match="expected fit_edges True or False"):
            Recognizer(rec.model, rec.features, rec.alphabet, fit_edges=bad)
    stub = _SaysLoud(rec.model.config)
    rec.model = stub
    audio = _burst(1.5, 2.0)
    assert rec.transcribe(audio, 8000) == "a"
    first = stub.calls[0]
    assert first == int(FeatureConfig().frames(len(audio)))
    # where the stub spoke in the first pass, by hand: the burst's output frames
    features, frames = LogMel()(audio[None], torch.tensor([len(audio)]))
    loud = (features[0].mean(-1) > 0.0).nonzero().flatten()
    span = (int(loud[0]) // 4, int(loud[-1]) // 4)
    start, end = span[0] * 320 - 2000, (span[1] + 1) * 320 + 200 - 80 + 4000
    assert 0 < start < 12000 and 15200 < end < len(audio)  # around the burst (samples 12000-15200)
    assert stub.calls[1] == int(FeatureConfig().frames(end - start))
    assert 2 <= len(stub.calls) <= 1 + recognizer.MAX_CUTS
    # what the cuts left: the same as transcribing the cut recording without cutting
    stub.calls.clear()
    rec.fit_edges = False
    assert rec.transcribe(audio, 8000) == "a" and stub.calls == [first]
    # short edges: nothing to cut or pad, one pass
    rec.fit_edges = True
    stub.calls.clear()
    short = _burst(0.15, 0.05)
    assert rec.transcribe(short, 8000) == "a" and len(stub.calls) == 1
    # only the recordings that are cut run again, batched or not
    stub.calls.clear()
    assert rec.transcribe_batch([short, audio, short], 8000) == ["a"] * 3
    assert sorted(stub.calls[:3]) == sorted(
        [int(FeatureConfig().frames(len(a))) for a in (short, audio, short)]
    )
    assert stub.calls[3] == int(FeatureConfig().frames(end - start))


def test_a_long_silence_between_two_words_is_cut(checkpoint):
    """Between two letters' output frames, the silence is cut to INNER_KEPT_MS after the first and before
    the second (where that removes at least MIN_CUT_MS; training's gaps between words are 30-300 ms), in
    the same pass as the edges; a short silence between words is left as it is."""
    from tandem.asr import recognizer

    assert recognizer.INNER_KEPT_MS == (200.0, 350.0)
    rec = Recognizer.from_checkpoint(checkpoint)
    stub = rec.model = _SaysLoud(rec.model.config)
    g = torch.Generator().manual_seed(0)
    quiet = lambda s: 1e-3 * torch.randn(round(s * 8000), generator=g)  # noqa: E731
    loud = lambda: 0.3 * torch.randn(3200, generator=g)  # noqa: E731
    audio = torch.cat([quiet(0.15), loud(), quiet(2.0), loud(), quiet(0.05)])  # edges too short to cut
    assert rec.transcribe(audio, 8000) == "aa"
    # the letters' output frames by hand, as in the edges' test: the hole between the two bursts
    features, _ = LogMel()(audio[None], torch.tensor([len(audio)]))
    frames = sorted({int(f) // 4 for f in (features[0].mean(-1) > 0.0).nonzero().flatten()})
    a, b = next((x, y) for x, y in zip(frames, frames[1:]) if y - x > 1)
    hole = (a + 1) * 320 + 200 - 80 + 350 * 8, b * 320 - 200 * 8
    assert 4400 < hole[0] < hole[1] < 1200 + 3200 + 16000  # inside the 2 s between the bursts
    assert stub.calls == [
        int(FeatureConfig().frames(n)) for n in (len(audio), len(audio) - (hole[1] - hole[0]))
    ]
    stub.calls.clear()
    near = torch.cat([quiet(0.15), loud(), quiet(0.3), loud(), quiet(0.05)])
    assert rec.transcribe(near, 8000) == "aa" and len(stub.calls) == 1


def test_a_recording_that_starts_on_its_first_word_is_padded_and_transcribed_again(checkpoint):
    """A first non-blank output frame within SPEECH_AT_START_MS of the start: PAD_MS of noise at
    PAD_LEVEL_DB below the recording's peak before and after it, one more pass; not with fit_edges=False."""
    from tandem.asr import recognizer

    assert (recognizer.SPEECH_AT_START_MS, recognizer.PAD_MS, recognizer.PAD_LEVEL_DB) == (60.0, 150.0, -50.0)
    rec = Recognizer.from_checkpoint(checkpoint)
    stub = rec.model = _SaysLoud(rec.model.config)
    bare = _burst(0.0, 0.05)
    assert rec.transcribe(bare, 8000) == "a"
    assert stub.calls == [int(FeatureConfig().frames(n)) for n in (len(bare), len(bare) + 2 * 1200)]
    padded = recognizer._padded(bare, 1200)
    assert torch.equal(padded[1200:-1200], bare) and torch.equal(recognizer._padded(bare, 1200), padded)
    level = padded[:1200].square().mean().sqrt() / bare.abs().max()
    assert 0.8 < float(level) * 10 ** (50 / 20) < 1.2, level
    stub.calls.clear()
    rec.fit_edges = False
    assert rec.transcribe(bare, 8000) == "a" and stub.calls == [int(FeatureConfig().frames(len(bare)))]


def _loud_frames(audio: torch.Tensor) -> list[int]:
    """The output frames at which ``_SaysLoud`` says 'a' on ``audio`` as it is, computed by hand."""
    features, _ = LogMel()(audio[None], torch.tensor([len(audio)]))
    return sorted({int(t) // 4 for t in (features[0].mean(-1) > 0.0).nonzero().flatten()})


def _frames(*samples: int) -> list[int]:
    return [int(FeatureConfig().frames(n)) for n in samples]


def test_speech_in_the_second_output_frame_is_padded_too(checkpoint):
    """SPEECH_AT_START_MS is 60 ms, an output frame 40 ms: a first word at output frame 1 (40-80 ms in)
    is padded and transcribed again, as one at frame 0; one at frame 2 (80 ms) is left as it is."""
    rec = Recognizer.from_checkpoint(checkpoint)
    stub = rec.model = _SaysLoud(rec.model.config)
    second, third = _burst(0.07, 0.05), _burst(0.1, 0.05)
    assert _loud_frames(second)[0] == 1 and _loud_frames(third)[0] == 2
    assert rec.transcribe(second, 8000) == "a"
    assert stub.calls == _frames(len(second), len(second) + 2 * 1200)
    stub.calls.clear()
    assert rec.transcribe(third, 8000) == "a" and stub.calls == _frames(len(third))


def test_padding_a_recording_does_not_depend_on_its_batch_mates(checkpoint):
    """A recording that starts on its first word is padded whether or not a recording batched with it
    had its edges cut (a transcript must not depend on what it is batched with): the model sees the same
    passes over each recording in a batch as over each alone."""
    rec = Recognizer.from_checkpoint(checkpoint)
    stub = rec.model = _SaysLoud(rec.model.config)
    bare, long = _burst(0.0, 0.05), _burst(1.5, 2.0)
    alone = {}
    for name, audio in (("bare", bare), ("long", long)):
        stub.calls.clear()
        assert rec.transcribe(audio, 8000) == "a"
        alone[name] = list(stub.calls)
    assert alone["bare"] == _frames(len(bare), len(bare) + 2 * 1200)  # padded
    assert len(alone["long"]) >= 2  # cut
    for batch in ([bare, long], [long, bare]):
        stub.calls.clear()
        assert rec.transcribe_batch(batch, 8000) == ["a", "a"]
        assert sorted(stub.calls) == sorted(alone["bare"] + alone["long"])


@pytest.mark.parametrize(
    "before_s, after_s, cut",
    [(0.35, 0.05, False), (0.4, 0.05, True), (0.35, 0.6, True)],
    ids=["70ms-left", "110ms-cut", "both-edges-cut"],
)
def test_edges_are_cut_only_where_that_removes_at_least_min_cut_ms(checkpoint, before_s, after_s, cut):
    """A recording whose edges hold a little more than EDGE_KEPT_MS is left as it is (one pass) where the
    cut would remove less than MIN_CUT_MS (800 samples at 8 kHz), both edges together; cut where it would
    remove that much."""
    rec = Recognizer.from_checkpoint(checkpoint)
    stub = rec.model = _SaysLoud(rec.model.config)
    audio = _burst(before_s, after_s)
    spoken = _loud_frames(audio)
    start, end = spoken[0] * 320 - 2000, min(len(audio), (spoken[-1] + 1) * 320 + 200 - 80 + 4000)
    removed = len(audio) - (end - start)
    assert start > 0 and (removed >= 800) == cut, (start, end, removed)
    assert rec.transcribe(audio, 8000) == "a"
    assert stub.calls[:2] == (_frames(len(audio), end - start) if cut else _frames(len(audio)))


@pytest.mark.parametrize("gap_s, cut", [(0.64, False), (0.72, True)], ids=["35ms-left", "115ms-cut"])
def test_a_silence_between_words_is_cut_only_where_that_removes_at_least_min_cut_ms(checkpoint, gap_s, cut):
    """Between two letters, a silence a little longer than INNER_KEPT_MS together is left as it is where
    cutting it to them would remove less than MIN_CUT_MS; cut where that removes at least MIN_CUT_MS."""
    rec = Recognizer.from_checkpoint(checkpoint)
    stub = rec.model = _SaysLoud(rec.model.config)
    g = torch.Generator().manual_seed(0)
    quiet = lambda s: 1e-3 * torch.randn(round(s * 8000), generator=g)  # noqa: E731
    loud = lambda: 0.3 * torch.randn(3200, generator=g)  # noqa: E731
    audio = torch.cat([quiet(0.15), loud(), quiet(gap_s), loud(), quiet(0.05)])  # edges too short to cut
    spoken = _loud_frames(audio)
    a, b = next((x, y) for x, y in zip(spoken, spoken[1:]) if y - x > 1)
    hole = (a + 1) * 320 + 200 - 80 + 350 * 8, b * 320 - 200 * 8
    assert hole[1] - hole[0] > 0 and (hole[1] - hole[0] >= 800) == cut, hole
    assert rec.transcribe(audio, 8000) == "aa"
    assert stub.calls == (
        _frames(len(audio), len(audio) - (hole[1] - hole[0])) if cut else _frames(len(audio))
    )


class _SaysLoudWithSpace(_SaysLoud):
    """``_SaysLoud``, and a space at the output frame halfway between its first and last 'a', where that
    frame is blank (a space in the pause between two words)."""

    def forward(self, features: torch.Tensor, frames: torch.Tensor):
        scores, out = super().forward(features, frames)
        best = scores.argmax(-1)  # [T', B]
        for b in range(len(frames)):
            said = best[: int(out[b]), b].nonzero().flatten()
            middle = (int(said[0]) + int(said[-1])) // 2 if len(said) else 0
            if len(said) and best[middle, b] == 0:
                scores[middle, b, ENGLISH.characters.index(" ") + 1] = 3.0
        return scores, out


def test_a_space_inside_a_long_silence_does_not_split_it(checkpoint):
    """A space is no letter: the silence between two words is cut between the letters around it, as one
    silence, whether or not the model says a space in it."""
    rec = Recognizer.from_checkpoint(checkpoint)
    stub = rec.model = _SaysLoudWithSpace(rec.model.config)
    g = torch.Generator().manual_seed(0)
    quiet = lambda s: 1e-3 * torch.randn(round(s * 8000), generator=g)  # noqa: E731
    loud = lambda: 0.3 * torch.randn(3200, generator=g)  # noqa: E731
    audio = torch.cat([quiet(0.15), loud(), quiet(2.0), loud(), quiet(0.05)])
    spoken = _loud_frames(audio)
    a, b = next((x, y) for x, y in zip(spoken, spoken[1:]) if y - x > 1)
    hole = (a + 1) * 320 + 200 - 80 + 350 * 8, b * 320 - 200 * 8
    assert rec.transcribe(audio, 8000) == "a a"
    assert stub.calls == _frames(len(audio), len(audio) - (hole[1] - hole[0]))


def test_a_batch_holds_at_most_padded_samples_whatever_the_order_given(checkpoint, monkeypatch):
    """Recordings are batched longest first, so a batch's padding (to its first recording) is what
    PADDED_SAMPLES bounds: short recordings given before a long one are not batched with it beyond that."""
    from tandem.asr import recognizer

    rec = Recognizer.from_checkpoint(checkpoint, fit_edges=False)
    stub = rec.model = _SaysLoud(rec.model.config)
    audio = [_burst(0.15, 0.05 + 0.01 * k, seed=k) for k in range(3)] + [_burst(0.15, 2.0, seed=3)]
    samples = {f: len(a) for f, a in zip(_frames(*map(len, audio)), audio)}
    assert len(samples) == len(audio)
    monkeypatch.setattr(recognizer, "PADDED_SAMPLES", 2 * len(audio[-1]))
    assert rec.transcribe_batch(audio, 8000, batch_size=16) == ["a"] * 4
    assert sorted(f for batch in stub.batches for f in batch) == sorted(samples)
    for batch in stub.batches:
        assert len(batch) * max(samples[f] for f in batch) <= 2 * len(audio[-1]), stub.batches


def test_a_files_seconds_are_its_share_by_length_of_its_batchs_time(tmp_path, checkpoint, monkeypatch):
    """A batch's time is shared among its files by length (the files' seconds add up to the time spent);
    where the batch fails and its files are transcribed alone, each has its own time plus its share of
    the failed attempt's. A clock that advances one second per forward pass and not otherwise."""
    import types

    from tandem.asr import recognizer

    clock = [0.0]
    monkeypatch.setattr(recognizer, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    rec = Recognizer.from_checkpoint(checkpoint, fit_edges=False)
    stub = rec.model = _SaysLoud(rec.model.config)
    forward = stub.forward
    audio = [_burst(0.15, s, seed=k) for k, s in enumerate((0.05, 0.5, 1.0))]
    files = [_write(tmp_path / f"{k}.wav", a.numpy(), 8000, "FLOAT") for k, a in enumerate(audio)]
    share = [len(a) / sum(len(a) for a in audio) for a in audio]

    def timed(features, frames):
        clock[0] += 1.0
        return forward(features, frames)

    monkeypatch.setattr(stub, "forward", timed)
    results = rec.transcribe_files(files, batch_size=3)
    assert [r.text for r in results] == ["a"] * 3 and clock[0] == 1.0
    assert [r.seconds for r in results] == pytest.approx(share)
    assert sum(r.seconds for r in results) == pytest.approx(clock[0])

    def out_of_memory_batched(features, frames):
        clock[0] += 1.0
        if len(frames) > 1:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 64 GB")
        return forward(features, frames)

    monkeypatch.setattr(stub, "forward", out_of_memory_batched)
    clock[0] = 0.0
    results = rec.transcribe_files(files, batch_size=3)
    assert [r.text for r in results] == ["a"] * 3 and clock[0] == 4.0
    assert [r.seconds for r in results] == pytest.approx([1.0 + s for s in share])
    assert sum(r.seconds for r in results) == pytest.approx(clock[0])


@pytest.mark.parametrize("fit_edges", [False, True], ids=["one-pass", "fitted"])
def test_transcripts_have_no_space_at_their_edges_nor_two_between_words(checkpoint, monkeypatch, fit_edges):
    """Greedy decoding keeps the spaces a model says in noise: ' six', 'one  two' reached the user (a
    comparison of strings counts them). The Recognizer's transcripts have single spaces between words."""
    from tandem.asr import recognizer

    said = [" one  two ", "  six", "three ", "", " "]
    monkeypatch.setattr(recognizer, "greedy_decode", lambda log_probs, *_: said[: log_probs.shape[1]])
    rec = Recognizer.from_checkpoint(checkpoint, fit_edges=fit_edges)
    audio = [_burst(0.15, 0.3, seed=k) for k in range(len(said))]
    assert rec.transcribe_batch(audio, 8000) == ["one two", "six", "three", "", ""]
