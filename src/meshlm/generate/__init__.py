"""Text generation: KV-cached, sharded decoding (``Generator``) and sampling."""

from meshlm.generate.generator import Generator
from meshlm.generate.streaming import GenerationResult

__all__ = ["GenerationResult", "Generator"]
