"""Flash attention: ``O = softmax(Q Kᵀ · scale + mask) V`` tile by tile, the online-softmax state carried across K/V tiles.

The online-softmax core's ``alpha = e^(m_old - m_new)`` rescales the output
accumulator as well as the denominator, so the L×L scores never exist.

Modules, each importing only those listed after it:

* ``api``: ``flash_attention`` (checks, the custom ops ``flashlite::flash_attention(_backward)`` and their
  autograd rule, the routes kept by signature);
* ``route``: a call's launches planned once (``Route``) and replayed; ``attention_forward``;
* ``split_kv``: decoding, a query tile's keys split over programs whose partial
  ``(m, d, acc)`` are merged;
* ``backward``: dQ, dK, dV (and a float mask's gradient), P recomputed from the
  forward's final states;
* ``forward``: the ``triton.language`` kernel and its K/V loop ``attend_kv_tiles``;
* ``forward_hopper``: the same loop in Gluon for Hopper, a product in flight under the softmax;
* ``merge``: ``merge_attention_states``, two partial ``(o, lse)`` over disjoint keys merged
  (ring attention's merge, ``flashlite.distributed``);
* ``plan``: which kernel and tiles a call runs on, and the variants' kernel arguments; ``tuning``: the tables;
* ``reference``: the PyTorch path (fp32, scores materialised) for tensors the kernels do not run on.
"""

from .api import flash_attention, flash_attention_varlen
from .merge import merge_attention_states

__all__ = ["flash_attention", "flash_attention_varlen", "merge_attention_states"]
