"""Prompts to token ids and token ids to text, for the HF runner: one tokenizer, one lock.

A chat (``spec.messages``) goes through the tokenizer's chat template with the generation prompt
added when the tokenizer has a template, else through ``spec.text`` (the plain rendering).
Encodings are cached per prompt, since admission prices each candidate before the runner sees it.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

from zkqueue.protocol.spec import JobSpec

#: A chat as a hashable key: ((("role", ...), ("content", ...)), ...).
_Chat = tuple[tuple[tuple[str, str], ...], ...]
#: A token is at most this many characters' bytes (byte-level BPE splits a UTF-8 character).
_BYTES_PER_CHAR = 4


class Codec:
    """Encodes job prompts and decodes outputs with ``tokenizer`` (thread-safe)."""

    def __init__(self, tokenizer: Any, eos_ids: set[int], context_length: int) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = frozenset(eos_ids)
        self.context_length = context_length
        self._lock = threading.Lock()  # a Rust tokenizer must not be used by two threads
        self._cached = functools.lru_cache(maxsize=1024)(self._encode_uncached)

    def encode(self, spec: JobSpec) -> list[int]:
        """The prompt's token ids, special tokens included."""
        chat = None if spec.messages is None else tuple(tuple(m.items()) for m in spec.messages)
        return list(self._cached(spec.prompt, chat))

    def decode(self, tokens: list[int]) -> str:
        with self._lock:
            return str(self.tokenizer.decode(tokens, skip_special_tokens=True))

    def context_error(self, prompt_tokens: int, max_new_tokens: int) -> str | None:
        """Why a prompt of this length with this many new tokens can never run, or None."""
        if prompt_tokens == 0:
            return "the prompt encodes to no tokens"
        limit = self.context_length
        if prompt_tokens + max_new_tokens > limit:
            return (
                f"prompt is {prompt_tokens} tokens; with max_new_tokens={max_new_tokens} that "
                f"exceeds the model context of {limit} tokens (at most "
                f"{max(0, limit - max_new_tokens)} prompt tokens for this max_new_tokens)"
            )
        return None

    def trim(self, tokens: list[int], ignore_eos: bool = False) -> tuple[list[int], str]:
        """The tokens before the first end of sequence, and the finish reason ("stop" at an end
        of sequence, else "length")."""
        if not ignore_eos:
            for i, token in enumerate(tokens):
                if token in self.eos_ids:
                    return tokens[:i], "stop"
        return tokens, "length"

    def stop_cut(self, tokens: list[int], stops: tuple[str, ...] | None) -> str | None:
        """The text before the first stop string once one appeared in ``tokens``; None until
        then. Called every step, so only a tail long enough to hold a new stop is decoded."""
        if not stops:
            return None
        window = _BYTES_PER_CHAR * max(map(len, stops)) + _BYTES_PER_CHAR
        tail = self.decode(tokens[-window:])
        if not any(stop in tail for stop in stops):
            return None
        text = self.decode(tokens)
        found = [i for i in (text.find(stop) for stop in stops) if i >= 0]
        return text[: min(found)] if found else None

    def _encode_uncached(self, prompt: str, chat: _Chat | None) -> tuple[int, ...]:
        messages = None if chat is None else tuple(dict(m) for m in chat)
        with self._lock:
            if messages is not None and getattr(self.tokenizer, "chat_template", None):
                out = self.tokenizer.apply_chat_template(
                    list(messages), add_generation_prompt=True, tokenize=True
                )
                ids = out["input_ids"] if hasattr(out, "keys") else out
            else:
                text = prompt if messages is None else JobSpec(prompt="", messages=messages).text
                ids = self.tokenizer(text)["input_ids"]
        return tuple(int(i) for i in ids)


def eos_ids(model: Any, tokenizer: Any) -> set[int]:
    """Every token that ends a sequence: the generation config's (one or a list) and the
    tokenizer's."""
    configured = model.generation_config.eos_token_id
    ids = set(configured if isinstance(configured, list) else [configured])
    ids.add(tokenizer.eos_token_id)
    return {int(i) for i in ids if i is not None}
