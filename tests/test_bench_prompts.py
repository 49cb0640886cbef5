"""The real-text prompts of the latency benchmarks have exactly the length asked for, end with the question,
and never share a first block (each would otherwise be a prefix-cache hit for the next); random-id prompts
read their model's limits from its config."""

from __future__ import annotations

import random
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers

from benchmarks.prompts import DOCUMENTS, QUESTION, RealPrompts, model_limits


def _word_tokenizer(root: Path) -> Path:
    """A word-level tokenizer knowing every word, mark and digit of the prompts (no unknown token in them)."""
    split = pre_tokenizers.Sequence(
        [pre_tokenizers.Whitespace(), pre_tokenizers.Digits(individual_digits=True)]
    )
    texts = (*DOCUMENTS, QUESTION, "Request 0123456789.")
    pieces = {piece for text in texts for piece, _ in split.pre_tokenize_str(text)}
    tok = Tokenizer(
        models.WordLevel({"[UNK]": 0, **{w: i + 1 for i, w in enumerate(sorted(pieces))}}, "[UNK]")
    )
    tok.pre_tokenizer = split
    tok.save(str(root / "tokenizer.json"))
    return root


def test_document_prompts_have_the_asked_length_and_distinct_starts(tmp_path: Path) -> None:
    prompts = RealPrompts(_word_tokenizer(tmp_path))
    rng = random.Random(0)
    question = prompts.encode(QUESTION)
    made = [prompts.document(n, rng) for n in (64, 64, 400, 2000)]
    assert [len(p) for p in made] == [64, 64, 400, 2000]
    assert all(p[-len(question) :] == question for p in made)
    assert all(0 not in p for p in made), "every piece of text is known to the test tokenizer"
    assert len({tuple(p[:4]) for p in made}) == len(made)  # "Request <n>." alone tells them apart
    assert prompts.document(5, rng) and len(prompts.document(5, rng)) == 5


def test_model_limits_are_the_configs_vocabulary_and_context(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"vocab_size": 4096, "max_position_embeddings": 1024, "x": 1}')
    limits = model_limits(tmp_path)
    assert (limits.vocab, limits.max_len) == (4096, 1024)
