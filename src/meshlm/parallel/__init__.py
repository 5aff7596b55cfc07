"""Parallelism: mesh axes, the ``Parallel`` context, shard_map wrappers, the sharding rules table, devices,
multi-process runtime and launcher.

Nothing is imported here: importing a subpackage must not start JAX before the CLI sets devices.
"""
