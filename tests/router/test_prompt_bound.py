"""Short prompts are routed on an upper bound of their token count, without tokenizing.

The bound (``tokenize.ByteBound``) must never be below the real count: checked by property tests on
byte-level BPE tokenizers trained here, in every variant the bound accepts (NFC, prefix space, a BOS
post-processor). Pipelines it cannot bound get no bound. Through the router: a short prompt never reaches
the tokenizer, a long one is counted exactly, and a resumed stream reports the exact prompt count.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers

from router.tokenize import PromptTokenizer, byte_bound
from tests.router.conftest import MODEL, long_prompt
from tests.router.sse import payloads

SPECIALS = ["<s>", "</s>", "<|im_start|>"]
CORPUS = [
    "hello world, the quick brown fox jumps over the lazy dog 0123456789",
    "naïve café – Grüße aus Köln; 東京 タワー 👋🏽 ΑΒΓ",
] * 20


def _byte_level(root: Path, nfc: bool, prefix_space: bool, bos: bool) -> Path:
    tok = Tokenizer(models.BPE())
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=prefix_space)
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
        )
    out = root / f"bpe-{nfc}-{prefix_space}-{bos}"
    out.mkdir()
    tok.save(str(out / "tokenizer.json"))
    return out


@pytest.fixture(scope="module")
def byte_level_tokenizers(tmp_path_factory: pytest.TempPathFactory) -> list[PromptTokenizer]:
    root = tmp_path_factory.mktemp("bpe")
    return [
        PromptTokenizer(_byte_level(root, nfc, prefix, bos))
        for nfc, prefix, bos in [
            (False, False, True),
            (True, False, False),
            (False, True, True),
            (True, True, False),
        ]
    ]


texts = st.lists(
    st.one_of(st.text(max_size=40), st.sampled_from([*SPECIALS, " ", "\u0958", "\U0001d160", "Ω", "ﬁ"])),
    max_size=8,
).map("".join)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=texts, special=st.booleans())
def test_the_bound_is_never_below_the_count(
    byte_level_tokenizers: list[PromptTokenizer], text: str, special: bool
) -> None:
    for tok in byte_level_tokenizers:
        bound = tok.upper_bound(text, special)
        assert bound is not None
        assert tok.count(text, special) <= bound


def test_ascii_bound_is_the_byte_count_plus_specials(byte_level_tokenizers: list[PromptTokenizer]) -> None:
    plain = byte_level_tokenizers[0]  # no NFC, no prefix space, BOS added
    assert plain.upper_bound("hello world", True) == 11 + 1
    assert plain.upper_bound("hello world", False) == 11


def _spec(tok: Tokenizer) -> dict:
    return json.loads(tok.to_str())


def test_pipelines_that_cannot_be_bounded_get_no_bound() -> None:
    metaspace = Tokenizer(models.BPE())
    metaspace.pre_tokenizer = pre_tokenizers.Metaspace()
    replace = Tokenizer(models.BPE(byte_fallback=True))
    replace.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    nfkc = Tokenizer(models.BPE())
    nfkc.normalizer = normalizers.NFKC()
    nfkc.pre_tokenizer = pre_tokenizers.ByteLevel()
    word_level = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    for tok in (metaspace, replace, nfkc, word_level):
        assert byte_bound(_spec(tok), 0) is None
    byte_level = Tokenizer(models.BPE())
    byte_level.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    assert byte_bound(_spec(byte_level), 1) is not None


@pytest.fixture
def bounded(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Give the unit tests' word-level tokenizer a (true) bound, and record every exact count."""
    counted: list[str] = []
    ids = PromptTokenizer.ids

    def spy(self: PromptTokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
        counted.append(text)
        return ids(self, text, add_special_tokens)

    monkeypatch.setattr(
        PromptTokenizer, "upper_bound", lambda self, text, special=True: len(text.encode()) + 1
    )
    monkeypatch.setattr(PromptTokenizer, "ids", spy)
    return counted


async def test_short_prompts_are_not_tokenized_and_long_ones_are(make_cluster, bounded: list[str]) -> None:
    c = await make_cluster(n_decode=1)  # threshold 32 tokens
    r = await c.router.post("/v1/completions", json={"model": MODEL, "prompt": "a b c", "max_tokens": 2})
    assert r.status == 200 and r.headers["X-PD-Route"] == "local"
    assert bounded == []
    r = await c.router.post(
        "/v1/completions", json={"model": MODEL, "prompt": long_prompt(), "max_tokens": 2}
    )
    assert r.status == 200 and r.headers["X-PD-Route"] == "disagg"
    assert bounded == [long_prompt()]  # its bound (>= 32) proves nothing: counted


async def test_a_context_overflow_is_still_caught_exactly(make_cluster, bounded: list[str]) -> None:
    c = await make_cluster(n_decode=1, model__max_model_len=8)
    body = {"model": MODEL, "prompt": "a b c d e f g", "max_tokens": 2}  # 7 + 2 tokens > 8
    r = await c.router.post("/v1/completions", json=body)
    assert r.status == 400 and "7 prompt tokens" in (await r.json())["error"]["message"]


async def test_a_resumed_stream_reports_the_exact_prompt_count(make_cluster, bounded: list[str]) -> None:
    c = await make_cluster(n_decode=3)
    c.decode[0].die_after_tokens = 3
    c.decode[1].die_after_tokens = 1
    workers = c.state.balancer.decode.workers
    workers[1].active, workers[2].active = 5, 10  # D0 first, then D1, then D2
    body = {
        "model": MODEL,
        "prompt": "a b c",
        "max_tokens": 6,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    r = await c.router.post("/v1/completions", json=body)
    raw = await r.read()
    assert r.status == 200
    usage = [p for p in payloads(raw) if isinstance(p, dict)][-1]["usage"]
    assert usage["prompt_tokens"] == 3  # the bound was 6
    assert usage["completion_tokens"] == 6
    assert [len(engine.requests) for engine in c.decode] == [1, 1, 1]  # resumed twice
    assert bounded == ["a b c"]  # counted once, for the first resume
