"""Training a byte-level BPE tokenizer (Hugging Face ``tokenizers``' trainer) on a corpus.

Every one of the 256 bytes is in the alphabet, so there is no unknown token and any UTF-8 text
round-trips exactly; the end-of-document special token is id 0. The result is an ``HFTokenizer``
whose ``to_json()`` is the tokenizer.json to save.

This module must not import jax: it runs before the CLI has chosen the devices.
"""

from __future__ import annotations

from collections.abc import Iterable

from meshlm.data.hf_tokenizer import EOD_TOKEN, HFTokenizer
from meshlm.errors import DataError

MIN_VOCAB = 257  # the special token and the 256 bytes
MAX_VOCAB = 2**20  # far past any useful size; ids still fit in uint32


def check_vocab_size(vocab_size: int) -> None:
    if not MIN_VOCAB <= vocab_size <= MAX_VOCAB:
        raise DataError(
            f"--vocab-size {vocab_size} is out of range: a byte-level BPE needs at least {MIN_VOCAB} "
            f"(256 bytes + the end-of-document token) and at most {MAX_VOCAB}"
        )


def train_bpe(texts: Iterable[str], vocab_size: int, *, length: int | None = None) -> HFTokenizer:
    """A byte-level BPE with ``vocab_size`` ids trained on ``texts`` (``length``: how many, for the
    trainer's bookkeeping). It may come out smaller when the corpus has fewer distinct merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    check_vocab_size(vocab_size)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer, length=length)
    return HFTokenizer(tokenizer=tok, eod_token=EOD_TOKEN, source="trained BPE")
