"""What a worker failure costs ``tandem train`` with its defaults: one worker killed, torchrun restarts.

    python benchmarks/restart_after_kill.py --out runs/kill --after 100 [-- extra train options]

Starts ``tandem train`` (2 processes), sends SIGKILL to the rank-1 worker ``--after`` seconds later and
lets torchrun restart the group. Prints the age of the newest checkpoint at the kill (the training that
is lost and done again), the time from the kill to the restarted group's first optimizer step, and the
run's result and wall time. The kill falls wherever ``--after`` puts it in the checkpoint interval.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

# the checkout's src/ first, so the code measured is this checkout's (as benchmarks/run.py does)
_SRC = Path(__file__).resolve().parent.parent / "src"
_ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(_SRC), os.environ.get("PYTHONPATH")]))}


def _worker(out: Path, local_rank: int) -> int:
    """The pid of this run's worker with ``LOCAL_RANK=local_rank`` (torchrun puts it in the environment)."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if str(out) in cmdline and f"LOCAL_RANK={local_rank}".encode() in environ:
            return int(pid)
    raise SystemExit(f"restart_after_kill: no worker with LOCAL_RANK={local_rank} for {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/kill"))
    parser.add_argument("--after", type=float, default=100.0, help="seconds from the start to the kill")
    parser.add_argument("extra", nargs="*", help="after --: more options for tandem train")
    args = parser.parse_args()

    lines: list[tuple[float, str]] = []  # (time, line), carriage returns (progress bars) split too
    start = time.time()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tandem", "train", "--out", str(args.out), *args.extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**_ENV, "PYTHONUNBUFFERED": "1"},
    )

    def read() -> None:
        for chunk in iter(lambda: proc.stdout.read(256), ""):
            now = time.time()
            lines.extend((now, part) for part in re.split(r"[\r\n]+", chunk) if part.strip())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    time.sleep(args.after)
    newest = max(args.out.glob("checkpoint-*.pt"), key=lambda p: p.stat().st_mtime)
    victim = _worker(args.out, 1)
    killed = time.time()
    os.kill(victim, signal.SIGKILL)
    lost = killed - newest.stat().st_mtime
    code = proc.wait()
    reader.join(10)
    end = time.time()

    after = [(t, line) for t, line in lines if t > killed]
    resumed = next((t for t, line in after if "resuming at step" in line), None)
    # the first progress-bar line with a loss after the resume: the restarted group's first step
    stepped = next((t for t, line in after if resumed and t >= resumed and "loss=" in line), None)
    print(f"killed rank 1 at {killed - start:.1f} s; newest checkpoint {newest.name}, {lost:.1f} s old")
    if resumed is not None:
        print(f"the restarted group resumed from its checkpoint {resumed - killed:.1f} s after the kill")
    if stepped is not None:
        print(f"first optimizer step after the restart: {stepped - killed:.1f} s after the kill")
    print(next((line for _, line in reversed(lines) if line.startswith("done:")), "no closing line"))
    print(f"exit status {code}, wall {end - start:.1f} s")


if __name__ == "__main__":
    main()
