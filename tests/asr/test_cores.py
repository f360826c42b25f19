"""pin_to_cores: each rank of a node on cores of its own, in fresh processes (pinning this one would leave
the rest of the suite on one core)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
CORES = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []

_CHILD = """
import json, os
from tandem.asr.distributed import pin_to_cores
before = sorted(os.sched_getaffinity(0))
got = pin_to_cores({threads})
print(json.dumps([before, got, sorted(os.sched_getaffinity(0))]))
"""


def _child(script: str, **env: str) -> list:
    """What ``script``, run in a fresh process with this checkout's tandem and ``env`` (LOCAL_RANK and
    LOCAL_WORLD_SIZE only as given, with WORLD_SIZE as torchrun sets it on one node: tandem reads them only
    in a process torchrun started), prints as JSON on its last line."""
    child_env = {
        k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE")
    }
    if "LOCAL_WORLD_SIZE" in env:
        child_env["WORLD_SIZE"] = env["LOCAL_WORLD_SIZE"]
    child_env.update(env, PYTHONPATH=os.pathsep.join(filter(None, (str(SRC), os.environ.get("PYTHONPATH")))))
    done = subprocess.run(
        [sys.executable, "-c", script], env=child_env, capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def _pin(threads: int, **env: str) -> tuple[list[int], list[int] | None, list[int]]:
    before, got, after = _child(_CHILD.format(threads=threads), **env)
    return before, got, after


@pytest.mark.skipif(len(CORES) < 2, reason="needs sched_setaffinity and 2 cores")
@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_of_a_node_gets_its_own_core(rank):
    before, got, after = _pin(1, LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
    assert got == [before[rank]] and after == got


@pytest.mark.skipif(len(CORES) < 2, reason="needs sched_setaffinity and 2 cores")
@pytest.mark.parametrize(
    ("threads", "env"),
    [
        pytest.param(1, {}, id="single-process"),
        pytest.param(
            1, {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": str(len(CORES) + 1)}, id="more-ranks-than-cores"
        ),
        pytest.param(len(CORES), {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}, id="threads-do-not-fit"),
    ],
)
def test_nothing_is_pinned_where_the_ranks_do_not_fit(threads, env):
    before, got, after = _pin(threads, **env)
    assert got is None and after == before


_WORKERS = """
import json, os
import torch
from tandem.asr.distributed import WorkerCores, pin_to_cores

class Cores(torch.utils.data.Dataset):
    def __len__(self):
        return 2
    def __getitem__(self, i):
        return sorted(os.sched_getaffinity(0))

before = sorted(os.sched_getaffinity(0))
pin_to_cores(1)
init = WorkerCores(before) if {give_back} else None
loader = torch.utils.data.DataLoader(Cores(), batch_size=None, num_workers=1, worker_init_fn=init)
print(json.dumps([before, sorted(os.sched_getaffinity(0)), [list(c) for c in loader]]))
"""


@pytest.mark.skipif(len(CORES) < 2, reason="needs sched_setaffinity and 2 cores")
@pytest.mark.parametrize("give_back", [True, False])
def test_a_pinned_ranks_workers_get_the_cores_it_had(give_back):
    """tandem train pins a rank, then starts its DataLoader workers with WorkerCores: the workers run on
    every core the rank had before, the rank stays on its own (without WorkerCores they would share it)."""
    before, rank, workers = _child(_WORKERS.format(give_back=give_back), LOCAL_RANK="1", LOCAL_WORLD_SIZE="2")
    assert rank == [before[1]]
    assert workers == ([before, before] if give_back else [rank, rank])


_WARNINGS = """
import json, os, warnings
import torch
from tandem.asr.corpus import load_spoken_digits
from tandem.asr.distributed import Group, pin_to_cores
from tandem.asr.interrupt import end_workers
from tandem.asr.model import ModelConfig
from tandem.asr.training import Run, TrainConfig, digit_sets

before = sorted(os.sched_getaffinity(0))
pin_to_cores(1)
os.environ.pop("WORLD_SIZE")  # rank 1 of 2 in its cores; a group of one for the run
config = TrainConfig(model=ModelConfig(hidden=8, layers=1, conv_channels=2), epochs=1)
run = Run(config, Group(torch.device("cpu"), 10), digit_sets(load_spoken_digits()))
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    steps = run.batches(2, before if {give_back} else None)
next(steps)
end_workers(steps)
print(json.dumps([str(w.message)[:60] for w in seen]))
"""


@pytest.mark.skipif(len(CORES) < 2, reason="needs sched_setaffinity and 2 cores")
@pytest.mark.parametrize("give_back", [True, False])
def test_a_pinned_ranks_workers_are_not_warned_of_as_too_many(give_back):
    """torch warns of "excessive worker creation" where a rank's workers outnumber its cores: a pinned
    rank has one, and its two workers (tandem train's default with manifests) were warned of twice a run,
    though they run on the cores the rank had before (WorkerCores). Still warned of where they do not."""
    seen = _child(_WARNINGS.format(give_back=give_back), LOCAL_RANK="1", LOCAL_WORLD_SIZE="2")
    warned = [m for m in seen if m.startswith("This DataLoader will create 2 worker processes")]
    assert len(warned) == (0 if give_back else 2), seen  # torch warns as it makes the loader and its iterator
