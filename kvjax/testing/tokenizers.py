"""SmolLM2's tokenizer, parsed once per process for the tests and simulators that read it."""

from __future__ import annotations

import functools

from kvjax.models.loading import gguf_loader
from kvjax.models.loading.tokenizer import Tokenizer


@functools.cache
def smollm2_tokenizer(pre_tokenizer: str | None = None) -> Tokenizer:
  """The tokenizer of SmolLM2-135M-Instruct's GGUF (`Tokenizer.from_gguf`), one per
  `pre_tokenizer` per process.

  Parsing the GGUF's vocabulary and merges takes seconds; callers only read the tokenizer (no
  caller may change the object it is given). `gguf_loader.read_gguf_metadata` keeps only the
  last two files' metadata, so a test that reads other GGUFs in between would otherwise pay
  the parse again.

  Args:
    pre_tokenizer: `Tokenizer.from_gguf`'s override ("smollm", "gpt2"); None: the file's.

  Raises:
    FileNotFoundError: the SmolLM2 GGUF package is not installed (not cached: a later call
      looks again).
  """
  return Tokenizer.from_gguf(gguf_loader.find_smollm2_gguf(), pre_tokenizer=pre_tokenizer)
