"""Softmax and log-sum-exp over one dimension: rows held on chip or streamed, merged by the online-softmax core.

* **fused** (``fused``): a whole row (several when rows are short) is one tile
  held on chip: one read of ``x``, one write of ``y``. On a GPU, rows longer
  than one program holds are held by several resident programs that merge their
  partial states (``shared_rows``); many 16-bit rows of up to 65536 are read
  twice by a program each instead.
* **online** (``online``): a row streamed in blocks, twice; split across
  programs when rows are few, their partial states merged by a second launch.

Rows of odd length are read in frames of whole 16-byte vectors (``frames``).
Both regimes accumulate in fp32 and write the input dtype (or ``dtype``). The
backward ``dx = y * (dy - sum(dy * y))`` follows the same regimes (``backward``).
``plan`` chooses a regime from the tables of ``tuning``; ``api`` holds the
public functions. CPU tensors run these kernels through Triton's interpreter
when ``TRITON_INTERPRET=1``; otherwise ``torch.softmax`` in fp32.

Modules, each importing only those listed after it: api, backward, shared_rows,
online, fused, plan, frames, tuning.
"""

from .api import logsumexp, softmax

__all__ = ["softmax", "logsumexp"]
