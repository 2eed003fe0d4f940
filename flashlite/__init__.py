"""flashlite: Triton kernels built on the online-softmax rescaling of a running maximum and denominator."""

from .softmax import logsumexp, softmax

__all__ = ["softmax", "logsumexp"]
__version__ = "0.1.0"
