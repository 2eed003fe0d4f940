"""flashlite: Triton kernels built on the online-softmax rescaling of a running maximum and denominator."""

from . import nn, study
from .attention import flash_attention
from .masked_softmax import masked_softmax
from .softmax import logsumexp, softmax

__all__ = ["softmax", "logsumexp", "masked_softmax", "flash_attention", "study", "nn"]
__version__ = "0.1.0"
