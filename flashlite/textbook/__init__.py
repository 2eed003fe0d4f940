"""The textbook kernels: the shortest correct form of each idea, beside the fast ones.

* ``fused_softmax``: one row a program, the row held on chip (one read, one write).
* ``online_softmax``: one row a program, streamed in blocks twice (the running ``(m, d)``, then ``y``).
* ``flash_attention_forward``: one query tile a program, a loop over K/V tiles whose ``alpha``
  rescales the output accumulator as it rescales ``d``.

Each imports the core's update and merge (``flashlite.core.online_softmax``) rather than writing them
again; ``bench/`` times them beside the fast kernels, one refinement at a time. They have no PyTorch path:
they take CUDA tensors, or CPU tensors with ``TRITON_INTERPRET=1`` set before ``triton`` is imported.
"""

from .flash_attention_forward import flash_attention_forward
from .fused_softmax import fused_softmax
from .online_softmax import online_softmax

__all__ = ["fused_softmax", "online_softmax", "flash_attention_forward"]
