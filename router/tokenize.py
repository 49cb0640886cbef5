"""Count prompt tokens the way the engines will: the model's HF ``tokenizers`` file and its chat template.

Runs in the router process for every request (the disaggregation policy needs the prompt length, the
context-length check needs it before anything is sent upstream, and KV-aware routing hashes the ids). ``transformers`` is deliberately not used:
it is heavy to import; the chat template is rendered with jinja2 in a sandbox (templates come with model
files and must not run arbitrary code), with the same options transformers uses (trim_blocks, lstrip_blocks,
loop controls). Like vLLM, completions add the tokenizer's special tokens and chat prompts do not (the
template writes them).
"""

from __future__ import annotations

import asyncio
import json
from datetime import datetime
from pathlib import Path
from typing import Any, NamedTuple, NoReturn

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from router.errors import bad_request

# Above this many characters (~1 ms of tokenizing) the work moves to a thread, where tokenizers releases the
# GIL, so a long prompt does not stall the other requests' streams.
_INLINE_CHARS = 2048

# Pre-tokenizers that only cut the text into pieces (they add no characters).
_SPLITTERS = frozenset({"Split", "Whitespace", "WhitespaceSplit", "Punctuation", "Digits", "UnicodeScripts"})


class ByteBound(NamedTuple):
    """How a byte-level BPE tokenizer's token count is bounded by its input's UTF-8 length.

    Every token of a byte-level BPE covers at least one byte of the text it is given, and a special or added
    token matched in the input covers at least one byte of it, so ``count <= factor * bytes + prefix_spaces
    + specials``: ``factor`` 3 under NFC normalization (NFC grows UTF-8 text by at most 3x, UAX #15), one
    prefix space per piece with ``add_prefix_space`` (at most one piece per byte, plus one), and ``specials``
    the tokens the post-processor adds.
    """

    factor: int
    prefix_space: bool
    specials: int

    def of(self, nbytes: int, add_special_tokens: bool) -> int:
        return (
            self.factor * nbytes
            + (nbytes + 1 if self.prefix_space else 0)
            + (self.specials if add_special_tokens else 0)
        )


def byte_bound(spec: dict[str, Any], specials: int) -> ByteBound | None:
    """The ``ByteBound`` of a ``tokenizer.json`` (``spec``), or None when its pipeline is not one whose count
    is provably bounded this way (SentencePiece-style Metaspace/Replace pipelines, NFKC, WordPiece, ...)."""
    if (spec.get("model") or {}).get("type") != "BPE":
        return None
    normalizer = spec.get("normalizer")
    if normalizer is None:
        factor = 1
    elif normalizer.get("type") == "NFC":
        factor = 3
    else:
        return None
    pre = spec.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers") or [] if pre.get("type") == "Sequence" else [pre]
    byte_level = [p for p in parts if p.get("type") == "ByteLevel"]
    if len(byte_level) != 1 or any(p.get("type") not in _SPLITTERS | {"ByteLevel"} for p in parts):
        return None
    return ByteBound(factor, bool(byte_level[0].get("add_prefix_space")), specials)


def _raise_exception(message: str) -> NoReturn:
    raise TemplateError(message)


def _special(cfg: dict[str, Any], name: str) -> str:
    value = cfg.get(name)
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


class PromptTokenizer:
    """Tokenizer + chat template of one model directory (loaded once at start-up)."""

    def __init__(self, model_dir: str | Path) -> None:
        root = Path(model_dir)
        try:
            self._tok = Tokenizer.from_file(str(root / "tokenizer.json"))
        except Exception as e:  # tokenizers raises its own Exception subclass
            raise ValueError(f"cannot load {root / 'tokenizer.json'}: {e}") from None
        self._bound = byte_bound(json.loads(self._tok.to_str()), len(self._tok.encode("").ids))
        cfg_path = root / "tokenizer_config.json"
        cfg: dict[str, Any] = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: use the default one
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        jinja_file = root / "chat_template.jinja"
        if jinja_file.exists():
            template = jinja_file.read_text()
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self._template = env.from_string(template) if isinstance(template, str) else None
        self._specials = {
            name: _special(cfg, name) for name in ("bos_token", "eos_token", "pad_token", "unk_token")
        }

    def ids(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The token ids the engine will see (KV-aware routing hashes them; their count is the length)."""
        # encode_batch_fast skips offset tracking: ~3x less work than encode() for the same ids.
        ids: list[int] = self._tok.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids
        return ids

    def text(self, ids: list[int]) -> str:
        """``ids`` as text, special tokens skipped (what vLLM streams by default); bytes of a character cut
        short come out as U+FFFD."""
        text: str = self._tok.decode(ids, skip_special_tokens=True)
        return text

    def count(self, text: str, add_special_tokens: bool = True) -> int:
        return len(self.ids(text, add_special_tokens))

    def upper_bound(self, text: str, add_special_tokens: bool = True) -> int | None:
        """At least ``count(text)``, from the text's UTF-8 length alone, or None for tokenizers without a
        ``ByteBound``. Why: tokenizing costs ~100 µs on a core that was just idle or busy relaying (it is ~13 µs
        only in a hot loop), and for a prompt whose bound is below the disaggregation threshold the exact
        count changes nothing (see ``requests.parse``)."""
        if self._bound is None:
            return None
        return self._bound.of(len(text.encode()), add_special_tokens)

    async def ids_async(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) <= _INLINE_CHARS:
            return self.ids(text, add_special_tokens)
        return await asyncio.to_thread(self.ids, text, add_special_tokens)

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Any = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The prompt text the engine builds from ``messages`` (raises a 400 ``ApiError`` on template errors)."""
        if self._template is None:
            raise bad_request("this model has no chat template; use /v1/completions", "messages")
        try:
            text = self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                tools=tools,
                **self._specials,
                **(chat_template_kwargs or {}),
            )
        except Exception as e:  # jinja errors, sandbox violations, template bugs on odd input
            raise bad_request(f"cannot apply the chat template: {e}", "messages") from None
        if continue_final_message and messages:
            last = messages[-1].get("content")
            if isinstance(last, str) and last and last in text:
                text = text[: text.rindex(last) + len(last)]
        return text
