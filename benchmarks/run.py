"""``python -m benchmarks.run --op gru``: the same options and code as ``tandem bench``.

Run from the repository root. The checkout's ``src/`` goes first on the path, so a fresh clone works
without installing and an installed tandem never stands in for the code being measured.
"""

from __future__ import annotations

import sys
from pathlib import Path

_SRC = Path(__file__).resolve().parent.parent / "src"
if (_SRC / "tandem").is_dir() and str(_SRC) not in sys.path:
    sys.path.insert(0, str(_SRC))

from tandem.cli.bench import main  # noqa: E402 (the path above must be set first)

if __name__ == "__main__":
    sys.exit(main())
