"""Performance: the benchmark and its report, model FLOPs, collective counts (compiled, from HLO, and
the theoretical minimum), the matmul peak, memory per device.

Nothing is imported here: importing a subpackage must not start JAX before the CLI sets devices.
"""
