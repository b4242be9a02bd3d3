"""Constrained decoding: token masks from a grammar, with llguidance (an optional dependency,
`pip install kvjax[structured]`).

Ownership and flow. The engine owns one `Grammars` per tokenizer (its token table is built on the
first constrained request: about a second for SmolLM2's 49k tokens) and one `Constraint` per
constrained request, beside the request's sampling generator. Per step:

    dispatch the step (jit, asynchronous)   ──>   device computes logits of step t
    Constraint.allowed() per sampled row          host: the mask for the token step t samples
    logits to the host (waits)                    (depends only on tokens up to t-1)
    sample_token(logits, allowed)                 disallowed logits are -inf
    Constraint.accept(token)                      advance the matcher; `done` when the grammar
                                                  allows nothing but the end of the sequence

Sampling in kvjax runs on the host (`kvjax/engine/sampling.py`: the logits come back as f32[V]
anyway), so the mask is a bool[V] numpy array applied there; it is computed while the device runs
the step (`Engine._execute_ragged`), off the critical path. No program is compiled per request.

A tokenizer without an end-of-sequence token (the byte tokenizer of the `tiny` test model) gets
one beyond its vocabulary: the grammar can finish, and the request ends when it has (`done`).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from kvjax.models.loading.byte_tokenizer import ByteTokenizer
from kvjax.scheduler.request import StructuredOutput

#: What to install when llguidance is missing.
INSTALL_HINT = "pip install kvjax[structured]"

#: JSON the output is written in: no free whitespace (a model cannot pad a value with newlines
#: until it runs out of tokens), and Python's `json.dumps` separators.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def available() -> bool:
  """Whether llguidance can be imported."""
  try:
    import llguidance  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
  except ImportError:
    return False
  return True


def _llguidance():
  try:
    import llguidance  # pylint: disable=import-outside-toplevel
  except ImportError:
    raise ValueError(f"constrained decoding needs llguidance: `{INSTALL_HINT}`") from None
  return llguidance


def grammar_text(spec: StructuredOutput) -> str:
  """llguidance's grammar of `spec` (JSON Schema or Lark), checked without a tokenizer.

  Raises:
    ValueError: llguidance is missing, or the schema or grammar is invalid (its message).
  """
  llg = _llguidance()
  try:
    if spec.json_schema is not None:
      text = llg.LLMatcher.grammar_from_json_schema(spec.json_schema, overrides=JSON_OPTIONS)
    else:
      text = llg.LLMatcher.grammar_from_lark(spec.lark)
  except (ValueError, TypeError) as e:
    raise ValueError(f"invalid grammar: {e}") from None
  error = llg.LLMatcher.validate_grammar(text, None)
  if error:
    raise ValueError(f"invalid grammar: {error}")
  return text


class _ByteTable:
  """The byte tokenizer's table for llguidance's `TokenizerWrapper`: ids 0..255 are the bytes,
  id 256 the end of sequence (beyond the model's vocabulary)."""

  eos_token_id = 256
  bos_token_id = None
  tokens = [bytes([i]) for i in range(256)] + [b"</s>"]
  special_token_ids = [256]

  def __call__(self, text: bytes | str) -> list[int]:
    return list(text if isinstance(text, bytes) else text.encode("utf-8"))


class Grammars:
  """Builds `Constraint`s for one tokenizer; owns llguidance's token table (built on first use,
  under a lock).

  Args:
    tokenizer: the engine's tokenizer: `kvjax.models.loading.tokenizer.Tokenizer` (its
      `to_json_str()` and `eos_id`) or `ByteTokenizer`.
    vocab_size: V, the model's logits per row (masks have this length).
  """

  def __init__(self, tokenizer: Any, vocab_size: int):
    self._tokenizer, self.vocab_size = tokenizer, vocab_size
    self._table = None
    self._lock = threading.Lock()

  def _token_table(self):
    with self._lock:
      if self._table is None:
        llg = _llguidance()
        if isinstance(self._tokenizer, ByteTokenizer):
          self._table = llg.LLTokenizer(llg.TokenizerWrapper(_ByteTable()))
        else:
          self._table = llg.LLTokenizer(self._tokenizer.to_json_str(),
                                        eos_token=self._tokenizer.eos_id)
      return self._table

  def constraint(self, spec: StructuredOutput) -> "Constraint":
    """A fresh matcher of `spec` at the start of the output.

    Raises:
      ValueError: llguidance is missing, the model has no tokenizer, or the grammar is invalid.
    """
    if self._tokenizer is None:
      raise ValueError("constrained decoding needs the model's tokenizer")
    llg = _llguidance()
    table = self._token_table()
    matcher = llg.LLMatcher(table, grammar_text(spec), log_level=0)
    if matcher.is_error():
      raise ValueError(f"invalid grammar: {matcher.get_error()}")
    return Constraint(matcher, self.vocab_size, table.vocab_size)


class Constraint:
  """One request's grammar state: which tokens may come next, and the tokens taken.

  Args:
    matcher: llguidance's `LLMatcher` at the output's start.
    vocab_size: V, the model's.
    table_size: tokens in the matcher's table (the byte table's end token lies beyond V).
  """

  def __init__(self, matcher: Any, vocab_size: int, table_size: int):
    import llguidance.numpy as llg_np  # pylint: disable=import-outside-toplevel
    self._np = llg_np
    self._matcher = matcher
    self.vocab_size = vocab_size
    self._bits = llg_np.allocate_token_bitmask(1, max(vocab_size, table_size))
    self.done = False

  def allowed(self) -> np.ndarray:
    """bool[V]: the tokens the grammar allows next (the end-of-sequence token among them when
    the grammar may end here)."""
    self._np.fill_next_token_bitmask(self._matcher, self._bits)
    bits = np.unpackbits(self._bits.view(np.uint8), bitorder="little")
    return bits[:self.vocab_size].astype(bool)

  def accept(self, token: int) -> None:
    """Advances past the sampled `token`; `done` once nothing but the end may follow.

    Raises:
      RuntimeError: `token` was not allowed (the mask was not applied).
    """
    if not self._matcher.consume_token(int(token)):
      raise RuntimeError(f"token {token} breaks the grammar: {self._matcher.get_error()}")
    self.done = self._matcher.is_stopped()
