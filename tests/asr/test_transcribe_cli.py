"""``tandem transcribe``: one line per file in argument order, the Recognizer's transcripts; a bad file
is one line on stderr naming it (exit status 1) while the others are transcribed; a bad checkpoint is
one line and exit status 2 with nothing transcribed; ``-`` is standard input."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from _cli import env as cli_env

from tandem.asr import (
    ENGLISH,
    ConnectedDigits,
    DeepSpeech2,
    FeatureConfig,
    ModelConfig,
    Recognizer,
    load_spoken_digits,
    split_recordings,
)
from tandem.asr.checkpoint import save_checkpoint
from tandem.cli.main import main

sf = pytest.importorskip("soundfile")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A checkpoint of a small untrained model, three recordings of real speech (8 kHz PCM-16 mono,
    16 kHz float stereo, 44.1 kHz 24-bit) and the Recognizer's transcripts of them."""
    root = tmp_path_factory.mktemp("transcribe")
    torch.manual_seed(0)
    model = DeepSpeech2(ModelConfig(hidden=16, layers=1, conv_channels=4))
    state = {
        "model_config": model.config.to_dict(),
        "feature_config": FeatureConfig().to_dict(),
        "alphabet": ENGLISH.characters,
        "model": model.state_dict(),
    }
    save_checkpoint(state, root / "checkpoint.pt")
    recordings = load_spoken_digits()
    digits = ConnectedDigits(recordings, split_recordings(recordings)[1])
    audio = [digits.render(u).numpy() for u in digits.plan(seed=1)[:3]]
    files = [root / "a.wav", root / "b.wav", root / "c.wav"]
    sf.write(files[0], audio[0], 8000, subtype="PCM_16")
    b = np.repeat(audio[1], 2)  # 16 kHz by repetition: the content does not matter here
    sf.write(files[1], np.stack([b, 0.5 * b], 1), 16000, subtype="FLOAT")
    sf.write(files[2], np.repeat(audio[2], 5), 40000, subtype="PCM_24")
    texts = [r.text for r in Recognizer.from_checkpoint(root / "checkpoint.pt").transcribe_files(files)]
    assert all(t is not None for t in texts)
    return root, [str(f) for f in files], texts


def _run(capsys, *argv: str) -> tuple[int, list[str], list[str]]:
    code = main(["transcribe", *argv])
    out, err = capsys.readouterr()
    return code, out.splitlines(), err.splitlines()


def test_one_line_per_file_in_argument_order(setup, capsys):
    root, files, texts = setup
    order = [2, 0, 1, 0]
    for batch_size in ("1", "3"):
        code, out, err = _run(
            capsys,
            "--model",
            str(root / "checkpoint.pt"),
            "--batch-size",
            batch_size,
            *(files[i] for i in order),
        )
        assert (code, err) == (0, [])
        assert out == [f"{files[i]}\t{texts[i]}" for i in order]


def test_one_pass_transcribes_in_one_pass(setup, capsys, monkeypatch):
    """The default cuts long silence at the edges and transcribes again (Recognizer's fit_edges, tested
    in test_recognizer); --one-pass is one pass over each recording as it is."""
    root, files, texts = setup
    asked = []
    loader = Recognizer.from_checkpoint.__func__

    def spy(cls, path, device="cpu", **kwargs):
        asked.append(kwargs.get("fit_edges", True))
        return loader(cls, path, device, **kwargs)

    monkeypatch.setattr(Recognizer, "from_checkpoint", classmethod(spy))
    one_pass = Recognizer.from_checkpoint(root / "checkpoint.pt", fit_edges=False).transcribe_files(files)
    asked.clear()
    for flags, expected in (([], texts), (["--one-pass"], [r.text for r in one_pass])):
        code, out, err = _run(capsys, "--model", str(root / "checkpoint.pt"), *flags, *files)
        assert (code, err) == (0, [])
        assert out == [f"{f}\t{t}" for f, t in zip(files, expected)]
    assert asked == [True, False]


def test_a_name_with_a_newline_or_tab_is_escaped_and_its_line_marked(setup, capsys, tmp_path):
    """``path<TAB>text``: a newline in a name split its line in two, a tab moved the text. Such a name is
    written escaped, its line starting with a backslash (sha256sum's convention); others as they are."""
    import shutil

    root, files, texts = setup
    odd = [tmp_path / "two\nlines.wav", tmp_path / "a\\tab\there.wav"]
    for path, source in zip(odd, files):
        shutil.copy(source, path)
    code, out, err = _run(capsys, "--model", str(root / "checkpoint.pt"), str(odd[0]), files[2], str(odd[1]))
    assert (code, err) == (0, [])
    assert out == [
        f"\\{tmp_path}/two\\nlines.wav\t{texts[0]}",
        f"{files[2]}\t{texts[2]}",
        f"\\{tmp_path}/a\\\\tab\\there.wav\t{texts[1]}",
    ]


@pytest.mark.parametrize(
    "breaks, escaped", [("\n", "\\n"), ("\r", "\\r")], ids=["newline", "carriage-return"]
)
def test_the_error_line_of_a_name_with_a_newline_is_one_line(setup, capsys, tmp_path, breaks, escaped):
    """A missing file named across two lines was reported on two lines of stderr: its one line names it
    with the newline (or carriage return) escaped, and the others go on."""
    root, files, texts = setup
    code, out, err = _run(
        capsys, "--model", str(root / "checkpoint.pt"), str(tmp_path / f"miss{breaks}ng.wav"), files[2]
    )
    assert code == 1 and out == [f"{files[2]}\t{texts[2]}"]
    assert len(err) == 1 and f"miss{escaped}ng.wav" in err[0], err


def test_a_name_with_a_backslash_is_escaped_as_sha256sum_escapes_it(setup, capsys, tmp_path):
    """A backslash in a name was written as it is: the file ``\\nx.wav`` printed as the escaped name of
    ``<newline>x.wav``. As sha256sum writes them, a name with a backslash is escaped (``\\\\``) and its
    line marked with a leading backslash, so the two lines differ."""
    import shutil

    root, files, texts = setup
    odd = [tmp_path / "\\nx.wav", tmp_path / "\nx.wav", tmp_path / "back\\slash.wav"]
    for path in odd:
        shutil.copy(files[0], path)
    code, out, err = _run(capsys, "--model", str(root / "checkpoint.pt"), *map(str, odd), files[2])
    assert (code, err) == (0, [])
    assert out == [
        f"\\{tmp_path}/\\\\nx.wav\t{texts[0]}",
        f"\\{tmp_path}/\\nx.wav\t{texts[0]}",
        f"\\{tmp_path}/back\\\\slash.wav\t{texts[0]}",
        f"{files[2]}\t{texts[2]}",
    ]


def test_names_that_standard_output_cannot_encode_are_written_as_escapes(setup, monkeypatch, tmp_path):
    """Under PYTHONIOENCODING=latin-1 a name with a character beyond it ended the run in a
    UnicodeEncodeError traceback, the files after it lost. The character is written as Python's escape (the
    line marked as an escaped name's), and a JSON line is written in ASCII; what the encoding holds is
    written as it is."""
    import shutil

    root, files, texts = setup
    names = [tmp_path / "ünï 声.wav", tmp_path / "ünï.wav"]
    for path in names:
        shutil.copy(files[0], path)
    for flag in ([], ["--json"]):
        output = io.TextIOWrapper(io.BytesIO(), encoding="latin-1", newline="\n")
        monkeypatch.setattr(sys, "stdout", output)
        code = main(["transcribe", "--model", str(root / "checkpoint.pt"), *flag, *map(str, names), files[2]])
        output.flush()
        lines = output.buffer.getvalue().decode("latin-1").splitlines()
        assert code == 0, lines
        if not flag:
            assert lines == [
                f"\\{tmp_path}/ünï \\u58f0.wav\t{texts[0]}",
                f"{tmp_path}/ünï.wav\t{texts[0]}",
                f"{files[2]}\t{texts[2]}",
            ]
        else:
            assert lines[0].isascii() and not lines[1].isascii() and "ünï.wav" in lines[1]
            records = [json.loads(line) for line in lines]
            assert [(r["path"], r["text"]) for r in records] == [
                *((str(n), texts[0]) for n in names),
                (files[2], texts[2]),
            ]


def test_json_lines(setup, capsys):
    root, files, texts = setup
    code, out, err = _run(capsys, "--model", str(root / "checkpoint.pt"), "--json", *files)
    assert (code, err) == (0, [])
    records = [json.loads(line) for line in out]
    assert [set(r) for r in records] == [{"path", "text", "audio_seconds", "compute_seconds"}] * 3
    assert [(r["path"], r["text"]) for r in records] == list(zip(files, texts))
    durations = [sf.info(f).duration for f in files]
    assert [r["audio_seconds"] for r in records] == pytest.approx(durations, abs=1e-4)
    assert all(r["compute_seconds"] > 0 for r in records)
    # a file that cannot be transcribed has its line too, in its place, with the error (and on stderr)
    missing = str(root / "missing.wav")
    code, out, err = _run(
        capsys, "--model", str(root / "checkpoint.pt"), "--json", files[0], missing, files[1]
    )
    records = [json.loads(line) for line in out]
    assert code == 1 and [r["path"] for r in records] == [files[0], missing, files[1]]
    assert records[1]["text"] is None and "no such file" in records[1]["error"] and len(err) == 1


@pytest.mark.parametrize(
    "case, expected",
    [
        ("missing", "no such file"),
        ("not-audio", "not a readable audio file"),
        ("empty", "empty recording (0 samples)"),
        ("silent", "silent recording"),
        ("directory", "not a file"),
        ("cancelling", "channels cancel out when mixed to mono"),
        (
            "truncated",
            "a truncated WAV file: its header announces 32000 bytes of samples, the file holds 16000",
        ),
    ],
)
def test_a_bad_file_is_named_on_stderr_and_the_others_are_transcribed(
    setup, capsys, tmp_path, case, expected
):
    root, files, texts = setup
    bad = tmp_path / f"{case}.wav"
    if case == "not-audio":
        bad.write_text("this is a text file\n")
    elif case == "empty":
        sf.write(bad, np.zeros(0), 8000, subtype="PCM_16")
    elif case == "silent":
        sf.write(bad, np.zeros(16000), 16000, subtype="PCM_16")
    elif case == "directory":
        bad.mkdir()
    elif case == "cancelling":  # one voice in opposite phase: the advice names a way from the command line
        voice = np.random.default_rng(0).uniform(-0.5, 0.5, 8000)
        sf.write(bad, np.stack([voice, -voice], 1), 8000, subtype="PCM_16")
    elif case == "truncated":  # a copy cut short: libsndfile reads its first half without a word
        sf.write(bad, np.random.default_rng(0).uniform(-0.5, 0.5, 16000), 8000, subtype="PCM_16")
        bad.write_bytes(bad.read_bytes()[: 44 + 16000])
    code, out, err = _run(capsys, "--model", str(root / "checkpoint.pt"), files[0], str(bad), files[2])
    assert code == 1
    assert out == [f"{files[0]}\t{texts[0]}", f"{files[2]}\t{texts[2]}"]
    assert len(err) == 1 and err[0].startswith(f"tandem transcribe: error: {bad}: ") and expected in err[0]
    if case == "cancelling":
        assert err[0].endswith("(sox in.wav -t wav - remix 1 | tandem transcribe -)")


@pytest.mark.parametrize("size", [0, 0xFFFFFFFF, 0x7FFFF000, 0x7FFFFFFF])
def test_a_wav_written_as_a_stream_is_not_taken_for_a_truncated_one(
    setup, capsys, tmp_path, monkeypatch, size
):
    """A writer that cannot know the length (sox, ffmpeg or arecord into a pipe) puts a placeholder in the
    header's data size (0, 0xFFFFFFFF, sox's 0x7FFFF000, 0x7FFFFFFF): such a file is read whole, not
    refused, from a file as from standard input."""
    root, files, texts = setup
    audio, rate = sf.read(files[0], dtype="int16")
    streamed = tmp_path / "streamed.wav"
    sf.write(streamed, audio, rate, subtype="PCM_16")
    data = bytearray(streamed.read_bytes())
    at = data.index(b"data") + 4
    data[at : at + 4] = size.to_bytes(4, "little")
    streamed.write_bytes(bytes(data))
    code, out, err = _run(capsys, "--model", str(root / "checkpoint.pt"), str(streamed))
    assert (code, err) == (0, []) and out == [f"{streamed}\t{texts[0]}"]
    monkeypatch.setattr(sys, "stdin", _Stdin(bytes(data)))
    code, out, err = _run(capsys, "--model", str(root / "checkpoint.pt"), "-")
    assert (code, err) == (0, []) and out == [f"-\t{texts[0]}"]


def test_a_truncated_wav_on_standard_input_is_refused_as_a_file_is(setup, capsys, monkeypatch):
    """Cut short, a WAV piped in was transcribed in part without a word (only files were checked)."""
    root, files, texts = setup
    whole = Path(files[0]).read_bytes()
    monkeypatch.setattr(sys, "stdin", _Stdin(whole[: len(whole) // 2]))
    code, out, err = _run(capsys, "--model", str(root / "checkpoint.pt"), "-", files[2])
    assert code == 1 and out == [f"{files[2]}\t{texts[2]}"]
    assert len(err) == 1 and err[0].startswith("tandem transcribe: error: <stdin>: a truncated WAV file: ")


def test_every_bad_file_gets_its_line(setup, capsys, tmp_path):
    root, files, texts = setup
    (tmp_path / "x.txt").write_text("x")
    code, out, err = _run(
        capsys, "--model", str(root / "checkpoint.pt"), "nope.wav", files[1], str(tmp_path / "x.txt")
    )
    assert code == 1 and out == [f"{files[1]}\t{texts[1]}"]
    assert [e.split(": ")[2] for e in err] == ["nope.wav", str(tmp_path / "x.txt")]


def _classify_checkpoint(path: Path) -> None:
    """What ``tandem train --task classify`` writes (src/tandem/cli/_train_worker.py)."""
    state = {"model": torch.nn.Linear(12, 9).state_dict(), "optimizer": {}, "epoch": 3, "history": []}
    torch.save({**state, "config": {"task": "classify"}, "train_seconds": 1.0}, path)


@pytest.mark.parametrize(
    "case, expected",
    [
        ("classify", "not a speech-recognizer checkpoint"),
        ("truncated", "not a readable checkpoint (truncated or corrupt?)"),
        ("missing", "no such file"),
        ("text", "not a readable checkpoint (truncated or corrupt?)"),
    ],
)
def test_a_checkpoint_that_is_not_a_recognizer_is_exit_2_and_nothing_is_transcribed(
    setup, capsys, tmp_path, case, expected
):
    root, files, _ = setup
    model = tmp_path / f"{case}.pt"
    if case == "classify":
        _classify_checkpoint(model)
    elif case == "truncated":
        model.write_bytes((root / "checkpoint.pt").read_bytes()[:-1000])
    elif case == "text":
        model.write_text("not a checkpoint\n")
    code, out, err = _run(capsys, "--model", str(model), *files)
    assert (code, out) == (2, [])
    assert (
        len(err) == 1
        and err[0].startswith(f"tandem transcribe: error: --model: {model}: ")
        and expected in err[0]
    )


class _Stdin:
    """``sys.stdin`` of a process fed ``data``: its binary ``buffer`` is named ``<stdin>``."""

    class _Buffer(io.BytesIO):
        name = "<stdin>"

    def __init__(self, data: bytes) -> None:
        self.buffer = self._Buffer(data)


def test_standard_input(setup, capsys, monkeypatch):
    root, files, texts = setup
    monkeypatch.setattr(sys, "stdin", _Stdin(Path(files[1]).read_bytes()))
    code, out, err = _run(capsys, "--model", str(root / "checkpoint.pt"), files[0], "-")
    assert (code, err) == (0, []) and out == [f"{files[0]}\t{texts[0]}", f"-\t{texts[1]}"]
    monkeypatch.setattr(sys, "stdin", _Stdin(b""))
    code, out, err = _run(capsys, "--model", str(root / "checkpoint.pt"), "-", files[2])
    assert code == 1 and out == [f"{files[2]}\t{texts[2]}"]
    assert err == ["tandem transcribe: error: <stdin>: empty input (0 bytes)"]
    code, out, err = _run(capsys, "--model", str(root / "checkpoint.pt"), "-", "-")
    assert (code, out) == (2, []) and err == [
        "tandem transcribe: error: - (standard input) can be given once"
    ]


def test_a_real_pipe_into_a_spawned_tandem(setup):
    """``python -m tandem transcribe ... - < file.wav``: the bytes of a pipe, and the exit status."""
    root, files, texts = setup
    env = cli_env()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tandem",
            "transcribe",
            "--model",
            str(root / "checkpoint.pt"),
            "-",
            "gone.wav",
        ],
        input=Path(files[2]).read_bytes(),
        capture_output=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr.decode()
    assert done.stdout.decode().splitlines() == [f"-\t{texts[2]}"]
    assert done.stderr.decode().splitlines() == ["tandem transcribe: error: gone.wav: no such file"]


def test_a_reader_that_leaves_is_status_1_without_a_word(setup):
    """``tandem transcribe ... | head -1``: the reader closes the pipe before the transcripts are written;
    status 1 (not every transcript was delivered: under ``set -o pipefail`` a script must not take the
    output for whole), no traceback, nothing on stderr."""
    root, files, _ = setup
    command = [sys.executable, "-m", "tandem", "transcribe", "--model", str(root / "checkpoint.pt"), *files]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=cli_env())
    proc.stdout.close()  # before the model has loaded: the first transcript meets a closed pipe
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 1 and err.decode() == ""


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_standard_output_that_fails_is_exit_2_in_one_line(setup):
    """``> /dev/full`` ended in a traceback, and ``>&-`` (stdout closed) in status 0 with every line
    dropped: both are now one line on stderr and status 2, as nothing was delivered."""
    root, files, _ = setup
    env = cli_env()
    command = [sys.executable, "-m", "tandem", "transcribe", "--model", str(root / "checkpoint.pt"), *files]
    with open("/dev/full", "w") as full:
        done = subprocess.run(command, stdout=full, stderr=subprocess.PIPE, env=env, timeout=120)
    assert done.returncode == 2
    assert done.stderr.decode().splitlines() == [
        "tandem transcribe: error: writing the transcripts to standard output: No space left on device"
    ]
    done = subprocess.run(
        ["sh", "-c", '"$@" >&-', "sh", *command], stderr=subprocess.PIPE, env=env, timeout=120
    )
    assert done.returncode == 2
    assert done.stderr.decode().splitlines() == [
        "tandem transcribe: error: standard output is closed: nowhere to write the transcripts"
    ]


def test_closed_standard_error_keeps_the_error_lines_out_of_the_transcripts(setup, tmp_path):
    """``2>&-``: print(file=sys.stderr) with sys.stderr None writes to stdout, so a file's error line
    landed among the transcripts (and broke the JSON lines); it goes nowhere now, the file's JSON line
    still says it failed, and the status says so."""
    root, files, texts = setup
    env = cli_env()
    command = [sys.executable, "-m", "tandem", "transcribe", "--model", str(root / "checkpoint.pt")]
    for json_lines in (False, True):
        args = [*command, *(["--json"] if json_lines else []), files[0], str(tmp_path / "gone.wav")]
        done = subprocess.run(
            ["sh", "-c", '"$@" 2>&-', "sh", *args], stdout=subprocess.PIPE, env=env, timeout=120
        )
        lines = done.stdout.decode().splitlines()
        assert done.returncode == 1 and len(lines) == (2 if json_lines else 1), lines
        if json_lines:
            records = [json.loads(line) for line in lines]
            assert records[0]["text"] == texts[0] and records[1]["text"] is None
        else:
            assert lines == [f"{files[0]}\t{texts[0]}"]
    # a message naming a file whose name is not UTF-8 (the null device wrote UTF-8 strictly: status 1)
    odd = os.fsencode(str(tmp_path)) + b"/\xff.pt"
    done = subprocess.run(
        ["sh", "-c", '"$@" 2>&-', "sh", *[os.fsencode(a) for a in command[:-2]], b"--model", odd, files[0]],
        stdout=subprocess.PIPE, env=env, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2 and done.stdout == b""


def test_usage_errors(setup, capsys):
    root, files, _ = setup
    with pytest.raises(SystemExit) as info:
        main(["transcribe", "--model", str(root / "checkpoint.pt"), "--batch-size", "0", files[0]])
    assert info.value.code == 2 and "expected a positive integer, got 0" in capsys.readouterr().err
    if not torch.cuda.is_available():
        code, out, err = _run(capsys, "--model", str(root / "checkpoint.pt"), "--device", "cuda", files[0])
        assert (code, out) == (2, []) and err == [
            "tandem transcribe: error: --device: Recognizer: device 'cuda' was asked for, "
            "but CUDA is not available"
        ]
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "transcribe" in capsys.readouterr().out


def test_ctrl_c_is_one_line_and_status_130(setup, capsys, monkeypatch):
    """Interrupted after the first file: its line stands, then one line on stderr (no traceback), and the
    shell's status for SIGINT."""
    root, files, texts = setup
    real = Recognizer.iter_transcribe_files

    def interrupted(self, sources, batch_size=16):
        iterator = real(self, sources, batch_size)
        yield next(iterator)
        raise KeyboardInterrupt

    monkeypatch.setattr(Recognizer, "iter_transcribe_files", interrupted)
    code, out, err = _run(capsys, "--model", str(root / "checkpoint.pt"), "--batch-size", "1", *files)
    assert (code, out, err) == (130, [f"{files[0]}\t{texts[0]}"], ["tandem transcribe: interrupted"])


def test_ctrl_c_while_the_model_loads_is_one_line_and_status_130(setup, capsys, monkeypatch):
    """Ctrl-C in the first second (torch importing, the checkpoint loading) was a traceback."""
    root, files, texts = setup

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(Recognizer, "from_checkpoint", interrupted)
    code, out, err = _run(capsys, "--model", str(root / "checkpoint.pt"), *files)
    assert (code, out, err) == (130, [], ["tandem transcribe: interrupted"])


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX file names are bytes")
def test_a_file_name_that_is_not_utf8_is_printed_as_its_bytes(setup, tmp_path):
    """A name with a byte that is not UTF-8 ended in a UnicodeEncodeError traceback (the files after it
    lost); its line now holds the name's own bytes, and its JSON line the escapes (valid JSON)."""
    root, files, texts = setup
    odd = os.fsencode(tmp_path) + b"/bad\xffname.wav"
    with open(odd, "wb") as f:
        f.write(Path(files[0]).read_bytes())
    env = dict(cli_env(), PYTHONIOENCODING="utf-8")  # strict, as under a usual en_US.UTF-8 locale
    command = [sys.executable, "-m", "tandem", "transcribe", "--model", str(root / "checkpoint.pt")]
    done = subprocess.run([*command, odd, files[1]], capture_output=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    assert done.stdout.splitlines() == [odd + b"\t" + texts[0].encode(), f"{files[1]}\t{texts[1]}".encode()]
    done = subprocess.run([*command, "--json", odd], capture_output=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    record = json.loads(done.stdout.decode("utf-8"))
    assert os.fsencode(record["path"]) == odd and record["text"] == texts[0]


def test_closed_standard_input_and_bytes_paths(setup, capsys, monkeypatch, tmp_path):
    """``-`` with standard input closed (``<&-``) is that file's error line, the others transcribed (an
    AttributeError traceback lost them); a bytes path is a path, named in messages as such."""
    root, files, texts = setup
    monkeypatch.setattr(sys, "stdin", None)
    code, out, err = _run(capsys, "--model", str(root / "checkpoint.pt"), "-", files[0])
    assert code == 1 and out == [f"{files[0]}\t{texts[0]}"]
    assert err == ["tandem transcribe: error: <stdin>: cannot read (standard input is closed)"]
    rec = Recognizer.from_checkpoint(root / "checkpoint.pt")
    got = rec.transcribe_files([os.fsencode(files[0]), os.fsencode(tmp_path / "gone.wav")])
    assert got[0].text == texts[0] and got[0].source == files[0]
    assert got[1].error == f"{tmp_path / 'gone.wav'}: no such file"
