"""A byte-level tokenizer (UTF-8 bytes are token ids 0..255) for the random `tiny` test model."""

from __future__ import annotations

from typing import Sequence


class ByteTokenizer:
  """Token id = byte value; no special tokens, no chat template beyond a plain join."""

  bos_id = None
  eos_id = None
  pad_id = None
  vocab_size = 256
  chat_template = None
  max_token_chars = 1  # one byte per token

  def encode(self, text: str, add_special_tokens: bool = True, *,
             parse_special: bool = True) -> list[int]:
    del add_special_tokens, parse_special  # no special tokens
    return list(text.encode("utf-8"))

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
    del skip_special_tokens
    return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

  def apply_chat_template(self, messages: list[dict[str, str]],
                          add_generation_prompt: bool = True) -> str:
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
    return text + ("assistant: " if add_generation_prompt else "")

  def encode_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True, *,
                  parse_special_in_content: bool = False) -> list[int]:
    del parse_special_in_content  # no special tokens
    return self.encode(self.apply_chat_template(messages, add_generation_prompt))

  def encode_chat_suffix(self, messages: list[dict[str, str]], start: int, *,
                         add_generation_prompt: bool = True,
                         rendered: str | None = None) -> list[int]:
    """Token ids of the rendered chat prompt from character `start` on (see
    `Tokenizer.encode_chat_suffix`).

    Raises:
      ValueError: `start` outside the rendered prompt.
    """
    text = (self.apply_chat_template(messages, add_generation_prompt) if rendered is None
            else rendered)
    if not 0 <= start <= len(text):
      raise ValueError(f"start={start} is outside the rendered prompt of {len(text)} characters")
    return self.encode(text[start:])
