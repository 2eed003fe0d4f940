"""flashlite: Triton kernels built on the online-softmax rescaling of a running maximum and denominator.

Layers, each importing only those below it (``.importlinter`` holds this):
``cli``; ``nn``, ``study``, ``integrations``, ``distributed``; ``attention``,
``masked_softmax``; ``softmax``, ``textbook``; ``core``.
"""

from .attention import flash_attention, flash_attention_varlen, merge_attention_states
from .masked_softmax import masked_softmax
from .softmax import logsumexp, softmax
from . import nn, study, textbook  # noqa: E402,I001  (after the functions: flashlite.softmax is the function)
from . import distributed  # noqa: E402,I001  ring attention over torch.distributed (touches no process group here)
from . import integrations  # noqa: E402,I001  flashlite.integrations.transformers: imports transformers when first used

__all__ = ["softmax", "logsumexp", "masked_softmax", "flash_attention", "flash_attention_varlen",
           "merge_attention_states", "study", "nn", "textbook", "distributed"]
__version__ = "0.2.0"
