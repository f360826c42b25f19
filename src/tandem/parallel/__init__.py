"""Data parallelism: ``DistributedDataParallel`` overlaps each bucket's all-reduce with the backward below it.

``tandem.parallel.DistributedDataParallel`` takes torch's arguments (plus ``timeout``); communication
hooks with torch's signature go through ``register_comm_hook``, the built-in ones are in
:mod:`tandem.parallel.hooks`.
"""

from __future__ import annotations

from tandem.parallel import hooks
from tandem.parallel.buckets import GradBucket
from tandem.parallel.comm import CommunicationError
from tandem.parallel.ddp import DEFAULT_TIMEOUT_S, DDPStats, DistributedDataParallel

__all__ = [
    "DistributedDataParallel",
    "DDPStats",
    "GradBucket",
    "CommunicationError",
    "DEFAULT_TIMEOUT_S",
    "hooks",
]
