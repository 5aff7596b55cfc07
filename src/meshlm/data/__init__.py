"""Data: tokenizers (bytes, tokenizer.json, BPE), corpus sources and split, stateless batches,
device placement, token checks.

Nothing is imported here: importing a subpackage must not start JAX before the CLI sets devices.
"""
