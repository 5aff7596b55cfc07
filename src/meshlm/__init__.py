"""meshlm: model-parallel language-model training in JAX + Haiku, proven equal to the unsharded model.

Importing ``meshlm`` does not import JAX (so the CLI can set ``XLA_FLAGS`` first); the library API is
loaded lazily on first use: ``meshlm.verify``, ``meshlm.get_config``, ...
"""

import importlib

__version__ = "0.1.0"

_LAZY = {
    "verify": ("meshlm.proof", "verify"),
    "get_config": ("meshlm.model.config", "get_config"),
    "ModelConfig": ("meshlm.model.config", "ModelConfig"),
    "Parallel": ("meshlm.parallel.context", "Parallel"),
    "make_mesh": ("meshlm.parallel.mesh", "make_mesh"),
}


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module 'meshlm' has no attribute {name!r}")
    module, attr = _LAZY[name]
    return getattr(importlib.import_module(module), attr)
