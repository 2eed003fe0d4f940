"""Hooks that plug flashlite into other libraries; each submodule imports its library only when used.

* ``flashlite.integrations.transformers``: ``register()`` adds ``attn_implementation="fl_attention"``
  to HuggingFace transformers (the optional extra ``pip install flashlite[transformers]``; the name
  cannot contain "flash", which transformers reserves for its FlashAttention-2 path).
"""

import importlib
import types

_SUBMODULES = ("transformers",)


def __getattr__(name: str) -> types.ModuleType:
    # ``flashlite.integrations.transformers`` after a bare ``import flashlite``: the submodule is imported on first
    # access (it imports its library only when used), so ``import flashlite`` stays free of transformers.
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
