"""Parallelism's ground floor: mesh axes, the ``Parallel`` context, the ``Layout``, placement, devices,
multi-process runtime and launcher. It imports nothing else of meshlm (``model`` builds on it; the
rules table and the shard_map'd loss are ``meshlm.sharding``, above ``model``).

Nothing is imported here: importing a subpackage must not start JAX before the CLI sets devices.
"""
