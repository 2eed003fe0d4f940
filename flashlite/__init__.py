"""flashlite: Triton kernels built on the online-softmax rescaling of a running maximum and denominator."""

from . import nn, study
from .attention import flash_attention
from .masked_softmax import masked_softmax
from .softmax import logsumexp, softmax
from . import ops  # noqa: E402,I001  registers torch.ops.flashlite.* (torch.compile), after the op modules

__all__ = ["softmax", "logsumexp", "masked_softmax", "flash_attention", "study", "nn"]
__version__ = "0.1.0"
