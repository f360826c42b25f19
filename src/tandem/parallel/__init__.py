"""Data parallelism: ``DistributedDataParallel`` overlaps each bucket's all-reduce with the backward below it.

``tandem.parallel.DistributedDataParallel`` takes torch's arguments (plus ``timeout``); communication
hooks with torch's signature go through ``register_comm_hook``, the built-in ones are in
:mod:`tandem.parallel.hooks`. ``tandem.parallel.ZeroAdagrad`` is Adagrad with its state sharded over
the ranks (ZeRO stage 1), for a model wrapped in ``DistributedDataParallel``.
"""

from __future__ import annotations

from tandem.parallel import hooks
from tandem.parallel.buckets import GradBucket
from tandem.parallel.comm import CommunicationError
from tandem.parallel.ddp import DEFAULT_TIMEOUT_S, DDPStats, DistributedDataParallel
from tandem.parallel.zero import ZeroAdagrad

__all__ = [
    "DistributedDataParallel",
    "ZeroAdagrad",
    "DDPStats",
    "GradBucket",
    "CommunicationError",
    "DEFAULT_TIMEOUT_S",
    "hooks",
]
