"""Group.from_lead: rank 0 computing alone for longer than the collective timeout (the check of a large
manifest) while the other ranks wait, in two fresh Gloo ranks on 127.0.0.1 (each bounded, always ended)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from _cli import free_port

SRC = Path(__file__).resolve().parents[2] / "src"

_RANK = """
import json, os, time
import torch
from tandem.asr.distributed import Group

# both ranks start Group together: its 1 s timeout bounds the rendezvous too, and a rank that imported
# torch over a second later than the other (a loaded machine) failed there, printing nothing
open(os.path.join(os.environ["READY"], os.environ["RANK"]), "w").close()
deadline = time.monotonic() + 50
while len(os.listdir(os.environ["READY"])) < 2 and time.monotonic() < deadline:
    time.sleep(0.01)
group = Group(torch.device("cpu"), timeout=1.0)  # the smallest --timeout

def compute():
    time.sleep(3.0)  # three timeouts
    if os.environ["MODE"] == "fails":
        raise ValueError("the check failed")
    return {"entries": [1, 2, 3]}

try:
    if os.environ["MODE"] == "one-broadcast":  # what the manifests' check did: the others waited in one
        got = group.broadcast(compute() if group.lead else None)
    else:
        got = group.from_lead(compute)
    print(json.dumps(["ok", got]))
except Exception as e:
    print(json.dumps([type(e).__name__, str(e)[:200]]))
"""


def _two_ranks(mode: str) -> list[list]:
    """What each rank of a 2-process group printed: ["ok", result] or [exception type, message]."""
    ready = tempfile.mkdtemp(prefix="tandem-group-")
    env = dict(os.environ, MODE=mode, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port())
    env["READY"] = ready
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(SRC), os.environ.get("PYTHONPATH"))))
    env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RANK], env=dict(env, RANK=str(r)), stdout=subprocess.PIPE, text=True
        )
        for r in range(2)
    ]
    try:
        outs = [p.communicate(timeout=60)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait(10)
        shutil.rmtree(ready, ignore_errors=True)
    return [json.loads(out.strip().splitlines()[-1]) for out in outs]


def test_the_others_wait_for_rank_0_past_the_collective_timeout():
    assert _two_ranks("from-lead") == [["ok", {"entries": [1, 2, 3]}]] * 2


def test_without_it_the_wait_ends_in_the_timeout():
    """The control: one broadcast that waits 3 s for rank 0 fails on the waiting rank."""
    _, rank_1 = _two_ranks("one-broadcast")
    assert rank_1[0] == "RuntimeError" and "Timed out" in rank_1[1], rank_1


def test_an_error_of_rank_0_is_raised_there_and_named_on_the_others():
    assert _two_ranks("fails") == [
        ["ValueError", "the check failed"],
        ["RuntimeError", "rank 0 failed while the other ranks waited for it (its error says why)"],
    ]


@pytest.mark.parametrize("timeout, heartbeat", [(1.0, 0.1), (60.0, 1.0)])
def test_the_heartbeat_is_well_inside_the_timeout(timeout, heartbeat):
    import torch

    from tandem.asr.distributed import Group

    assert Group(torch.device("cpu"), timeout).heartbeat == heartbeat
