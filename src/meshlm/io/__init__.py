"""Files users load and write: sharded checkpoints with integrity records, model checkpoints, Hugging Face
conversion.

Nothing is imported here: importing a subpackage must not start JAX before the CLI sets devices.
"""
