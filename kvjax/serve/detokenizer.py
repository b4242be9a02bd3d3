"""Incremental detokenization for streaming: new text as tokens arrive, never half a character.

Byte-level BPE tokens can end inside a UTF-8 character; decoding such a prefix yields U+FFFD for
the partial bytes. The window method of vLLM (`detokenize_incrementally`) decodes only the tokens
since the last clean boundary and holds text back while it ends in U+FFFD:

    ids:   [ ... emitted ... | prefix_offset ... read_offset | new ids ]
    delta = decode(ids[prefix_offset:])[len(decode(ids[prefix_offset:read_offset])):]

UTF-8 is self-synchronizing, so the deltas concatenate to `decode(ids)` wherever the boundary is a
complete character. Stop strings are held back as well: the last `max(len(stop)) - 1` characters
stay unsent until generation ends, so a stop string split across tokens is never streamed.
"""

from __future__ import annotations

from typing import Any, Sequence

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
  """Turns a growing list of output token ids into text deltas.

  Args:
    tokenizer: has `decode(ids, skip_special_tokens=...)` (the engine's tokenizer).
    stop: stop strings of the request (text matching one is never streamed).
  """

  def __init__(self, tokenizer: Any, stop: Sequence[str] = ()):
    self._tok = tokenizer
    self._holdback = max((len(s) for s in stop), default=1) - 1
    self._prefix_offset = 0
    self._read_offset = 0
    self._text = ""   # stable text decoded so far
    self.sent = ""    # text handed out so far (a prefix of `_text`)

  def _decode(self, ids: Sequence[int]) -> str:
    return self._tok.decode(ids, skip_special_tokens=True)

  def update(self, token_ids: Sequence[int]) -> str:
    """Returns the text that became safe to send since the last call.

    Args:
      token_ids: all output token ids so far (cumulative).
    """
    if len(token_ids) > self._read_offset:
      prefix = self._decode(token_ids[self._prefix_offset:self._read_offset])
      new = self._decode(token_ids[self._prefix_offset:])
      if len(new) > len(prefix) and not new.endswith(_REPLACEMENT):
        self._text += new[len(prefix):]
        self._prefix_offset, self._read_offset = self._read_offset, len(token_ids)
    safe = len(self._text) - self._holdback
    if safe <= len(self.sent):
      return ""
    delta = self._text[len(self.sent):safe]
    self.sent += delta
    return delta

  def finish(self, final_text: str) -> str:
    """Returns the rest of the final text (the engine's: stop string removed)."""
    if final_text.startswith(self.sent):
      delta = final_text[len(self.sent):]
    else:  # cannot happen for prefix-stable tokenizers; never resend what was sent
      delta = ""
    self.sent += delta
    return delta
