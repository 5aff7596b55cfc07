"""Text generation: KV-cached, sharded decoding (``Generator``) and sampling."""

from meshlm.generate.generator import GenerationResult, Generator

__all__ = ["GenerationResult", "Generator"]
