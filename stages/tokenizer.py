"""Text <-> tokens for the coordinator, from a stage file's vocabulary alone.

Every stage file carries the full tokenizer metadata, so the coordinator loads
the first stage's vocabulary (``vocab_only``: no weights) and needs no model.
"""

from __future__ import annotations

import codecs
import ctypes
import hashlib

from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from stages.engine import StageError, ensure_backend, meta_string, quiet_logs
from stages.llama import llama_cpp


class Tokenizer:
    def __init__(self, path: str):
        ensure_backend()
        quiet_logs()
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        self._model = llama_cpp.llama_model_load_from_file(path.encode(), params)
        if not self._model:
            raise StageError(f"{path}: llama.cpp could not read its vocabulary")
        self._vocab = llama_cpp.llama_model_get_vocab(self._model)
        self.chat_template = meta_string(self._model, "tokenizer.chat_template", 1 << 16)

    def tokenize(self, text: str, *, special: bool = False) -> list[int]:
        """Token ids of text, with the BOS token when the vocabulary asks for one.

        special: parse control tokens written in the text (chat templates).
        """
        data = text.encode()
        capacity = len(data) + 8
        buffer = (llama_cpp.llama_token * capacity)()
        count = llama_cpp.llama_tokenize(self._vocab, data, len(data), buffer, capacity, True, special)
        if count < 0:
            capacity = -count
            buffer = (llama_cpp.llama_token * capacity)()
            count = llama_cpp.llama_tokenize(self._vocab, data, len(data), buffer, capacity, True, special)
        return list(buffer[:count])

    def chat_prompt(self, user_text: str) -> list[int]:
        """Token ids of a one-message chat, formatted with the model's own template."""
        return self.chat_tokens([{"role": "user", "content": user_text}])

    def chat_tokens(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a chat ({role, content} messages), formatted with the
        model's own template (the GGUF's tokenizer.chat_template), ready for the
        assistant's reply."""
        return self.tokenize(self.chat_text(messages), special=True)

    def chat_text(self, messages: list[dict[str, str]]) -> str:
        """The text of chat_tokens (its control tokens written out)."""
        if not self.chat_template:
            raise StageError("this model has no chat template (tokenizer.chat_template); drop --chat")
        formatter = Jinja2ChatFormatter(
            self.chat_template, eos_token=self.piece(self.eos).decode(errors="replace"),
            bos_token=self.piece(self.bos).decode(errors="replace"), add_generation_prompt=True,
        )
        return formatter(messages=messages).prompt

    def vocabulary_digest(self) -> str:
        """SHA-256 of every token's text: equal digests mean interchangeable token ids."""
        digest = hashlib.sha256()
        for token in range(llama_cpp.llama_vocab_n_tokens(self._vocab)):
            buffer = ctypes.create_string_buffer(256)
            length = llama_cpp.llama_token_to_piece(self._vocab, token, buffer, len(buffer), 0, True)
            digest.update(buffer.raw[: max(length, 0)] + b"\0")
        return digest.hexdigest()

    @property
    def n_vocab(self) -> int:
        return llama_cpp.llama_vocab_n_tokens(self._vocab)

    @property
    def bos(self) -> int:
        return llama_cpp.llama_vocab_bos(self._vocab)

    @property
    def eos(self) -> int:
        return llama_cpp.llama_vocab_eos(self._vocab)

    def is_end(self, token: int) -> bool:
        """True for end-of-generation tokens (EOS, EOT, ...)."""
        return bool(llama_cpp.llama_vocab_is_eog(self._vocab, token))

    def piece(self, token: int) -> bytes:
        buffer = ctypes.create_string_buffer(64)
        length = llama_cpp.llama_token_to_piece(self._vocab, token, buffer, len(buffer), 0, False)
        if length < 0:
            buffer = ctypes.create_string_buffer(-length)
            length = llama_cpp.llama_token_to_piece(self._vocab, token, buffer, len(buffer), 0, False)
        return buffer.raw[:length]

    def text_stream(self) -> TextStream:
        return TextStream(self)


class TextStream:
    """Turns tokens into text as they come; a character split across tokens
    is printed once it is complete."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int) -> str:
        return self._decoder.decode(self._tokenizer.piece(token))

    def finish(self) -> str:
        return self._decoder.decode(b"", final=True)
