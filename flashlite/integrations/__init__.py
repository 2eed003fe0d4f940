"""Hooks that plug flashlite into other libraries; each submodule imports its library only when used.

* ``flashlite.integrations.transformers``: ``register()`` adds ``attn_implementation="fl_attention"``
  to HuggingFace transformers (the optional extra ``pip install flashlite[transformers]``; the name
  cannot contain "flash", which transformers reserves for its FlashAttention-2 path).
"""
