"""Text <-> token ids for the serving front ends: UTF-8 bytes, or a local Hugging Face tokenizer
(with its chat template, when it has one)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from graphpar.errors import GenerationError, UsageError

__all__ = ["Tokenizer"]


class Tokenizer:
    """``spec`` is ``bytes`` (UTF-8 bytes as token ids) or a Hugging Face tokenizer directory."""

    def __init__(self, spec: str = "bytes", option: str = "--tokenizer") -> None:
        self.spec = spec
        self.hf = None
        if spec != "bytes":
            path = Path(spec)
            if not path.is_dir():
                raise UsageError(f"{option} {spec}: not 'bytes' and not a tokenizer directory")
            try:
                from transformers import AutoTokenizer

                self.hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
            except Exception as exc:
                raise UsageError(f"{option} {spec}: cannot load it: {exc}") from None

    def encode(self, text: str) -> list[int]:
        if self.hf is not None:
            return list(self.hf.encode(text))
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        if self.hf is not None:
            return self.hf.decode(ids)
        return bytes(t for t in ids if 0 <= t < 256).decode("utf-8", errors="replace")

    @property
    def has_chat_template(self) -> bool:
        return self.hf is not None and bool(getattr(self.hf, "chat_template", None))

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        """The prompt's token ids for ``messages``, ending where the assistant's reply starts;
        GenerationError when the tokenizer has no chat template or the template fails."""
        if not self.has_chat_template:
            what = "UTF-8 bytes" if self.hf is None else f"the tokenizer in {self.spec}"
            raise GenerationError(
                f"the model's tokenizer ({what}) has no chat template, so chat messages cannot "
                f"be turned into a prompt: use /v1/completions, or serve with a --tokenizer "
                f"directory whose tokenizer_config.json has a chat_template")
        try:
            text = self.hf.apply_chat_template(messages, tokenize=False,
                                               add_generation_prompt=True)
        except Exception as exc:  # a Jinja error raised by the user's template
            raise GenerationError(f"the chat template failed on these messages: {exc}") from None
        # The template writes any special tokens itself (as vLLM does, no second BOS).
        return list(self.hf.encode(text, add_special_tokens=False))
