"""Performance: the benchmark, HLO collective counts, the matmul peak, memory per device.

Nothing is imported here: importing a subpackage must not start JAX before the CLI sets devices.
"""
