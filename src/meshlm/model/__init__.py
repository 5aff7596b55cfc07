"""The model: configs and presets, Haiku layers, attention, the transformer, parameter-path facts.

Nothing is imported here: importing a subpackage must not start JAX before the CLI sets devices.
"""
