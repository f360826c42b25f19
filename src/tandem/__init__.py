"""tandem: fast training of recurrent sequence models in PyTorch.

``tandem.nn.GRU`` is a drop-in ``torch.nn.GRU``; the math lives in ``tandem.ops`` as custom ops
(``torch.ops.tandem.*``) with a plain-PyTorch CPU kernel and, where Triton is present, GPU kernels.
"""

from __future__ import annotations

from tandem import nn, ops, optim, parallel

__version__ = "0.1.0"
__all__ = ["nn", "ops", "optim", "parallel", "__version__"]
