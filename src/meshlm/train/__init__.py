"""Training: config, optimizer, the jitted step, the loop with exact resume, metrics.

Nothing is imported here: importing a subpackage must not start JAX before the CLI sets devices.
"""
