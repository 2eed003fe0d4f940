"""The core every kernel of flashlite is built on, importing nothing above it.

* ``online_softmax``: the state ``(m, d)`` of a running maximum and denominator,
  its update, merge and rescale (of the denominator and of attention's output
  accumulator): the one idea of the package;
* ``partials``: partial states exchanged between programs (two launches, or a
  cooperative one with slots);
* ``masking``: which (query, key) positions count, and how a bias is added;
* ``tiles``: loading, storing and multiplying tiles, TMA descriptors;
* ``runtime``: where kernels run, device properties, launches;
* ``checks``: argument checks shared by the public functions;
* ``triton_compat``: every use of Triton's private API (fast launches, descriptors, ahead-of-time builds).
"""
