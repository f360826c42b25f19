"""Reading checkpoints: any file that is not a recognizer checkpoint is a CheckpointError naming it."""

from __future__ import annotations

import pytest
import torch

from tandem.asr.checkpoint import CheckpointError, CheckpointStore, load_checkpoint, save_checkpoint


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "checkpoint.pt"
    state = {"model_config": {}, "feature_config": {}, "alphabet": "ab", "model": {"w": torch.ones(3)}}
    save_checkpoint(state, path)
    return path


def test_a_saved_checkpoint_reads_back(saved):
    state = load_checkpoint(saved)
    assert state["format"] == "tandem.asr.recognizer" and state["version"] == 1
    assert torch.equal(state["model"]["w"], torch.ones(3))


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda data: b"", id="empty"),
        pytest.param(lambda data: b"hello\n", id="text"),  # the weights-only unpickler raised KeyError
        pytest.param(lambda data: bytes(range(256)) * 8, id="binary"),
        pytest.param(lambda data: data[: len(data) // 2], id="truncated"),
        pytest.param(lambda data: data[:100], id="header-only"),
    ],
)
def test_unreadable_files_are_checkpoint_errors_naming_the_file(tmp_path, saved, make):
    path = tmp_path / "bad.pt"
    path.write_bytes(make(saved.read_bytes()))
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    message = str(info.value)
    assert message.startswith(f"{path}: not a readable checkpoint (truncated or corrupt?): ")
    assert "\n" not in message


def test_bytes_changed_in_place_are_a_corrupt_checkpoint(tmp_path):
    """Bytes of a weight overwritten (a bad disk, a copy gone wrong): torch.load reads them as numbers, and
    a NaN weight transcribed every file to nothing with exit status 0. The archive's checksums tell."""
    path = tmp_path / "checkpoint.pt"
    weights = torch.ones(1000)
    save_checkpoint(
        {"model_config": {}, "feature_config": {}, "alphabet": "ab", "model": {"w": weights}}, path
    )
    data = bytearray(path.read_bytes())
    at = data.find(weights.numpy().tobytes()) + 2000
    data[at : at + 8] = b"\xff" * 8
    path.write_bytes(bytes(data))
    with pytest.raises(
        CheckpointError, match=r": a corrupt checkpoint \(.*/data/0: its checksum does not match\)$"
    ):
        load_checkpoint(path)


def test_a_model_with_non_finite_weights_is_refused_naming_the_weight(tmp_path):
    """Training never writes one; a checkpoint that holds one (edited, or written by other code) made every
    transcript empty."""
    path = tmp_path / "checkpoint.pt"
    for bad in (float("nan"), float("inf"), -float("inf")):
        model = {"w": torch.ones(3), "head.bias": torch.tensor([0.0, bad]), "steps": torch.tensor(3)}
        save_checkpoint({"model_config": {}, "feature_config": {}, "alphabet": "ab", "model": model}, path)
        with pytest.raises(
            CheckpointError, match=r"checkpoint.pt: the model's head.bias holds NaN or infinite values$"
        ):
            load_checkpoint(path)


def test_a_checkpoint_missing_a_part_is_refused_naming_what_is_missing(tmp_path):
    """Without the model (or the alphabet, the configurations) it is no recognizer: a CheckpointError
    naming the file and the parts, not a KeyError where a part is first used."""
    path = tmp_path / "checkpoint.pt"
    torch.save({"format": "tandem.asr.recognizer", "version": 1, "alphabet": "ab", "model_config": {}}, path)
    with pytest.raises(
        CheckpointError, match=r"checkpoint.pt: incomplete checkpoint, missing \['feature_config', 'model'\]"
    ):
        load_checkpoint(path)


@pytest.mark.parametrize("damaged", ["checkpoint.pt", "none", "no-checkpoint.pt"])
def test_latest_is_the_newest_readable_checkpoint_of_those_kept(tmp_path, damaged):
    """With checkpoint.pt unreadable (a bad disk), the newest numbered one that reads, not the oldest
    (a resume that went back further than it needed to); with it whole, it alone, nothing skipped;
    without it (deleted by hand), the newest numbered one, and no file said skipped."""
    store = CheckpointStore(tmp_path, keep=4)
    state = {"model_config": {}, "feature_config": {}, "alphabet": "ab", "model": {}, "step": 0}
    for step in (5, 10, 15, 20):
        store.save({**state, "step": step}, step)
    if damaged == "checkpoint.pt":
        store.path.unlink()  # a link to checkpoint-00000020.pt: that one stays whole
        store.path.write_bytes(b"garbage")
        (tmp_path / "checkpoint-00000020.pt").write_bytes(b"garbage too")
    if damaged == "no-checkpoint.pt":
        store.path.unlink()
    loaded, path, skipped = store.latest()
    if damaged == "no-checkpoint.pt":
        assert loaded["step"] == 20 and path.name == "checkpoint-00000020.pt" and skipped == []
    elif damaged == "checkpoint.pt":
        assert loaded["step"] == 15 and path.name == "checkpoint-00000015.pt"
        assert [s.split(":")[0] for s in skipped] == [
            str(store.path),
            str(tmp_path / "checkpoint-00000020.pt"),
        ]
    else:
        assert loaded["step"] == 20 and path == store.path and skipped == []


def test_a_pipe_or_device_is_named_as_such_not_as_missing(tmp_path):
    """``--model /dev/null`` or ``<(cat checkpoint.pt)`` exist: "no such file" sent people looking."""
    import os

    fifo = tmp_path / "pipe.pt"
    os.mkfifo(fifo)
    for path in (fifo, "/dev/null"):
        with pytest.raises(
            CheckpointError, match=f"^{path}: not a regular file \\(a pipe, a device or a socket\\)"
        ):
            load_checkpoint(path)


def test_leftovers_are_the_part_files_of_writes_cut_short_and_nothing_else(tmp_path):
    parts = [
        ".checkpoint-00000005.pt.tmp-123",
        ".checkpoint.pt.tmp-9",
        ".checkpoint.pt.link-7",
        ".metrics.json.tmp-44",
        ".training_curve.png.tmp-3",
    ]
    others = [".checkpoint_best.pt.tmp-2024", ".checkpoint.pt.tmp-12-3", ".mine.tmp-5", "checkpoint.pt"]
    for name in parts + others:
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / ".checkpoint.pt.tmp-77").symlink_to(tmp_path / "checkpoint.pt")  # a link: not followed
    assert [p.name for p in CheckpointStore(tmp_path).leftovers()] == sorted(parts)
