"""``tandem.asr``: the main job's application, a DeepSpeech-style speech recognizer built from tandem's
parts (the architecture: ``DESIGN.md`` in the project's shared folder): the bundled recordings and the
connected-digit generator, log-mel features, the model, CTC decoding, error rates, training, reading
recordings (:mod:`tandem.asr.audio`) and transcribing them (:class:`Recognizer`)."""

from __future__ import annotations

from tandem.asr.audio import AudioError, read_audio, to_model_input
from tandem.asr.augment import Augmentation
from tandem.asr.corpus import Recordings, load_spoken_digits
from tandem.asr.decode import greedy_decode
from tandem.asr.features import FeatureConfig, LogMel, mel_filterbank, resample
from tandem.asr.generator import ConnectedDigits, Utterance, split_recordings
from tandem.asr.metrics import ErrorRates, edit_distance, error_rates
from tandem.asr.model import TANDEM_PARTS, TORCH_PARTS, DeepSpeech2, ModelConfig, Parts
from tandem.asr.recognizer import FileTranscript, Recognizer
from tandem.asr.text import ENGLISH, Alphabet

__all__ = [
    "Alphabet",
    "AudioError",
    "Augmentation",
    "ConnectedDigits",
    "DeepSpeech2",
    "ENGLISH",
    "ErrorRates",
    "FeatureConfig",
    "FileTranscript",
    "LogMel",
    "ModelConfig",
    "Parts",
    "Recognizer",
    "Recordings",
    "TANDEM_PARTS",
    "TORCH_PARTS",
    "Utterance",
    "edit_distance",
    "error_rates",
    "greedy_decode",
    "load_spoken_digits",
    "mel_filterbank",
    "read_audio",
    "resample",
    "split_recordings",
    "to_model_input",
]
