"""A byte-level tokenizer for the router's streaming tests: every UTF-8 byte is one token, so a character
outside ASCII spans several tokens, none of them a character (as the tiny model's rarer characters do)."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from router.tokenize import PromptTokenizer


def byte_tokenizer(root: Path) -> PromptTokenizer:
    """Byte-level BPE without merges, saved under ``root`` (é: two tokens, neither a character)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        ["plain"], trainers.BpeTrainer(vocab_size=256, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    )
    tok.save(str(root / "tokenizer.json"))
    return PromptTokenizer(root)
