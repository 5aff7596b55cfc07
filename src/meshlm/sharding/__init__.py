"""Sharding a meshlm model: the rules table (parameter path -> PartitionSpec) and the shard_map'd loss.

Above ``model`` (the rules read its parameter-path facts and KV-head layout) and ``parallel`` (the
ground floor: axes, the ``Parallel`` context, ``Layout``, placement). Nothing is imported here.
"""
