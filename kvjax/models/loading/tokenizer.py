"""Byte-level BPE tokenizer and chat template rebuilt from GGUF metadata.

A GGUF carries its tokenizer as `tokenizer.ggml.*` metadata (vocabulary, merges, token types,
special ids) plus `tokenizer.chat_template`. `Tokenizer.from_gguf` rebuilds the equivalent Hugging
Face `tokenizers.Tokenizer` (GPT-2 style byte-level BPE with the pre-tokenizer named by
`tokenizer.ggml.pre`) and renders chat templates the way `transformers` does (a sandboxed jinja2
environment with `trim_blocks` and `lstrip_blocks`).

Special tokens written in *text* (`"<|im_start|>"`) map to their ids unless `encode` is told
`parse_special=False`; `encode_chat` tokenizes message content that way, so only the chat template
emits control tokens (a user cannot open a system turn of their own by writing one).

Reading a GGUF's 49k-token metadata takes seconds; `Tokenizer.save` writes the built tokenizer to a
directory (`tokenizer.json` plus `kvjax_tokenizer.json`) that `Tokenizer.load` restores in a
fraction of that. `Tokenizer.from_hf_dir` reads a Hugging Face model directory instead.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import secrets
import threading
from collections.abc import Sequence
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from kvjax.models.loading import gguf_loader

#: Files of a directory written by `Tokenizer.save`.
TOKENIZER_FILE = "tokenizer.json"
STATE_FILE = "kvjax_tokenizer.json"
_FORMAT_VERSION = 1
_HF_CONFIG_FILE = "tokenizer_config.json"
_HF_TEMPLATE_FILE = "chat_template.jinja"  # transformers 5 saves the template here

# llama.cpp token types (`gguf.TokenType`): 1 normal, 2 unknown, 3 control, 4 user defined,
# 5 unused, 6 byte.
_CONTROL, _USER_DEFINED = 3, 4


def _pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
  """Pre-tokenizer for llama.cpp's `tokenizer.ggml.pre` name (those SmolLM2/GPT-2 style use)."""
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  if pre == "smollm":
    # SmolLM / StarCoder (the model's own tokenizer.json, and llama.cpp): every digit is its own
    # pre-token, then GPT-2's regex runs on the stretches between digits. A whitespace run right
    # before a digit therefore stays whole ("\n\n1" -> "ĊĊ", "1"), whereas GPT-2's regex on the
    # whole text leaves the last whitespace to the digit's pre-token ("Ċ", "Ċ", "1").
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), byte_level])
  if pre in (None, "default", "gpt2", "gpt-2"):
    return byte_level
  raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r} (supported: smollm, gpt2, default)")


class ChatTemplateError(ValueError, jinja2.exceptions.TemplateError):
  """The model's chat template refused the messages (its `raise_exception`, e.g. "only user and
  assistant roles") or failed to render them: bad input, so a `ValueError`, and still the
  `jinja2.TemplateError` it was."""


def _raise_exception(message: str) -> None:
  raise ChatTemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
  # transformers overrides jinja's tojson, which would HTML-escape.
  return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                    sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
  return datetime.datetime.now().strftime(fmt)


def _read_json(path: str) -> Any:
  """Parsed JSON file; FileNotFoundError when absent, ValueError naming `path` when invalid."""
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path} not found")
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ValueError(f"{path}: invalid JSON: {e}") from e


def _read_tokenizer_json(path: str) -> tokenizers.Tokenizer:
  """`tokenizers.Tokenizer.from_file`; FileNotFoundError when absent, ValueError when invalid."""
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path} not found")
  try:
    return tokenizers.Tokenizer.from_file(path)
  except Exception as e:  # tokenizers raises plain Exception on malformed files.
    raise ValueError(f"{path}: invalid tokenizer file: {e}") from e


def _optional_id(state: dict[str, Any], key: str, path: str) -> int | None:
  value = state.get(key)
  if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
    raise ValueError(f"{path}: {key!r} must be an int or null, got {value!r}")
  return value


def _hf_token_id(tok: tokenizers.Tokenizer, config: dict[str, Any], key: str,
                 path: str) -> int | None:
  """Id of special token `key` of a `tokenizer_config.json` (str or {"content": str}), or None."""
  value = config.get(key)
  if isinstance(value, dict):
    value = value.get("content")
  if value is None:
    return None
  if not isinstance(value, str):
    raise ValueError(f"{path}: {key!r} must be a string or {{'content': string}}, got {value!r}")
  token_id = tok.token_to_id(value)
  if token_id is None:
    raise ValueError(f"{path}: {key} {value!r} is not in the vocabulary")
  return token_id


def _hf_model_eos_id(directory: str, vocab_size: int) -> int | None:
  """`eos_token_id` of a model folder's `generation_config.json`, else its `config.json` (the
  first of a list), or None: where `tokenizer_config.json` names no `eos_token`."""
  for name in ("generation_config.json", "config.json"):
    path = os.path.join(directory, name)
    if not os.path.isfile(path):
      continue
    value = _read_json(path)
    value = value.get("eos_token_id") if isinstance(value, dict) else None
    if isinstance(value, list):
      value = value[0] if value else None
    if value is None:
      continue
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab_size:
      raise ValueError(f"{path}: eos_token_id {value!r} is not a token id below {vocab_size}")
    return value
  return None


def _hf_chat_template(config: dict[str, Any], path: str) -> str | None:
  """`chat_template` of a `tokenizer_config.json`: a string, or the "default" of named ones."""
  template = config.get("chat_template")
  if template is None or isinstance(template, str):
    return template
  if isinstance(template, list):
    named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
    if isinstance(named.get("default"), str):
      return named["default"]
    raise ValueError(f"{path}: no chat template named 'default' (have {sorted(map(str, named))})")
  raise ValueError(f"{path}: chat_template must be a string or a list, got {type(template)}")


def _validate_messages(messages: Any) -> None:
  if not isinstance(messages, (list, tuple)):
    raise ValueError(f"messages must be a list of dicts, got {type(messages).__name__}")
  for i, m in enumerate(messages):
    if not isinstance(m, dict):
      raise ValueError(f"messages[{i}] must be a dict, got {type(m).__name__}")
    for key in ("role", "content"):
      if not isinstance(m.get(key), str):
        raise ValueError(f"messages[{i}][{key!r}] must be a str, got {m.get(key)!r}")


class Tokenizer:
  """Text <-> token ids, special tokens and chat template of one model.

  Attributes:
    chat_template: jinja2 source of the chat template, or None when the model has none.
  """

  def __init__(self, tokenizer: tokenizers.Tokenizer, *, bos_id: int | None, eos_id: int | None,
               pad_id: int | None = None, add_bos: bool = False,
               chat_template: str | None = None):
    """Wraps a built `tokenizers.Tokenizer`.

    Args:
      tokenizer: the BPE tokenizer, special tokens already registered.
      bos_id: beginning-of-sequence id, or None.
      eos_id: end-of-sequence id (generation stops on it), or None.
      pad_id: padding id, or None.
      add_bos: `encode(..., add_special_tokens=True)` prepends `bos_id`.
      chat_template: jinja2 chat template source, or None.
    """
    self._tok = tokenizer
    self._bos_id = bos_id
    self._eos_id = eos_id
    self._pad_id = pad_id
    self._add_bos = add_bos and bos_id is not None
    self.chat_template = chat_template
    self._compiled_template: jinja2.Template | None = None
    self._lock = threading.Lock()
    self._plain_tok: tokenizers.Tokenizer | None = None  # special tokens in text are plain text
    self._max_token_chars: int | None = None
    specials = [t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special]
    self._special_texts = tuple(t for t in specials if t)
    # Proper prefixes and suffixes of special tokens: content that ends with one (or starts with
    # one, or lies inside a special token) could complete a special token with the template's
    # text around it.
    self._special_prefixes = frozenset(t[:k] for t in self._special_texts
                                       for k in range(1, len(t)))
    self._special_suffixes = frozenset(t[k:] for t in self._special_texts
                                       for k in range(1, len(t)))

  @classmethod
  def from_gguf(cls, path: str | os.PathLike[str], *,
                pre_tokenizer: str | None = None) -> "Tokenizer":
    """Builds the tokenizer stored in a GGUF's `tokenizer.ggml.*` metadata.

    Args:
      path: GGUF file.
      pre_tokenizer: overrides the file's `tokenizer.ggml.pre` ("smollm", "gpt2"). "gpt2"
        reproduces `transformers`' GGUF loader, which drops SmolLM2's digit splitting and so
        differs from the model's own tokenizer.json on whitespace right before a digit.

    Returns:
      The tokenizer; CONTROL and USER_DEFINED tokens are registered as special added tokens, so
      `"<|im_start|>"` in text encodes to its single id.

    Raises:
      FileNotFoundError: `path` does not exist.
      ValueError: not a GGUF, tokenizer metadata missing, or a tokenizer model other than
        byte-level BPE ("gpt2") or an unsupported pre-tokenizer.
    """
    meta = gguf_loader.read_gguf_metadata(path)
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
      raise ValueError(
          f"{os.fspath(path)}: unsupported tokenizer model {model!r}, expected 'gpt2' (byte-level "
          "BPE)")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    types = meta.get("tokenizer.ggml.token_type", [1] * len(tokens))
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
      raise ValueError(f"{os.fspath(path)}: duplicate tokens in tokenizer.ggml.tokens")
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False,
                                          byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(pre_tokenizer or meta.get("tokenizer.ggml.pre"))
    tok.decoder = decoders.ByteLevel()
    special = [tokenizers.AddedToken(t, special=True, normalized=False)
               for t, ty in zip(tokens, types) if ty in (_CONTROL, _USER_DEFINED)]
    tok.add_special_tokens(special)
    return cls(
        tok,
        bos_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_id=meta.get("tokenizer.ggml.eos_token_id"),
        pad_id=meta.get("tokenizer.ggml.padding_token_id"),
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        chat_template=meta.get("tokenizer.chat_template"))

  @classmethod
  def from_hf_dir(cls, directory: str | os.PathLike[str]) -> "Tokenizer":
    """Reads the tokenizer of a Hugging Face model directory.

    Args:
      directory: holds `tokenizer.json` and, optionally, `tokenizer_config.json` with
        `bos_token`, `eos_token`, `pad_token` (strings or `{"content": ...}`), `add_bos_token`
        (default False) and `chat_template` (a string, or a list of `{"name", "template"}` of
        which the one named "default" is taken; without one, `chat_template.jinja` beside it,
        where transformers 5 saves it). Without `eos_token` the EOS is the `eos_token_id` of
        `generation_config.json`, else of `config.json` (the first of a list). Without any of
        these every special id is None and there is no chat template. `tokenizer.json`'s post-processor is not applied; BOS comes
        from `add_bos_token` only.

    Returns:
      The tokenizer.

    Raises:
      FileNotFoundError: `tokenizer.json` is missing.
      ValueError: a file is malformed, a special token is not in the vocabulary, or the list of
        chat templates has no "default".
    """
    directory = os.fspath(directory)
    tok = _read_tokenizer_json(os.path.join(directory, TOKENIZER_FILE))
    config_path = os.path.join(directory, _HF_CONFIG_FILE)
    config = _read_json(config_path) if os.path.isfile(config_path) else {}
    if not isinstance(config, dict):
      raise ValueError(f"{config_path}: expected a JSON object")
    add_bos = config.get("add_bos_token", False)
    if not isinstance(add_bos, bool):
      raise ValueError(f"{config_path}: 'add_bos_token' must be a bool, got {add_bos!r}")
    template = _hf_chat_template(config, config_path)
    template_path = os.path.join(directory, _HF_TEMPLATE_FILE)
    if template is None and os.path.isfile(template_path):
      with open(template_path, encoding="utf-8") as f:
        template = f.read()
    eos_id = _hf_token_id(tok, config, "eos_token", config_path)
    if eos_id is None:
      eos_id = _hf_model_eos_id(directory, tok.get_vocab_size(with_added_tokens=True))
    return cls(
        tok,
        bos_id=_hf_token_id(tok, config, "bos_token", config_path),
        eos_id=eos_id,
        pad_id=_hf_token_id(tok, config, "pad_token", config_path),
        add_bos=add_bos,
        chat_template=template)

  def save(self, directory: str | os.PathLike[str]) -> None:
    """Writes the tokenizer to `directory` (created if needed) for `Tokenizer.load`.

    Files: `tokenizer.json` (`tokenizers.Tokenizer.save`) and `kvjax_tokenizer.json` (special
    ids, `add_bos`, chat template, format version); existing ones are overwritten.

    Args:
      directory: destination directory.
    """
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    self._tok.save(os.path.join(directory, TOKENIZER_FILE))
    state = {"format_version": _FORMAT_VERSION, "bos_id": self._bos_id, "eos_id": self._eos_id,
             "pad_id": self._pad_id, "add_bos": self._add_bos,
             "chat_template": self.chat_template}
    with open(os.path.join(directory, STATE_FILE), "w", encoding="utf-8") as f:
      json.dump(state, f, ensure_ascii=False, indent=1)

  @classmethod
  def load(cls, directory: str | os.PathLike[str]) -> "Tokenizer":
    """Restores a tokenizer written by `save` (same ids, decoding and chat rendering).

    Args:
      directory: a directory written by `save`.

    Returns:
      The tokenizer.

    Raises:
      FileNotFoundError: `tokenizer.json` or `kvjax_tokenizer.json` is missing.
      ValueError: a file is malformed or has another format version.
    """
    directory = os.fspath(directory)
    state_path = os.path.join(directory, STATE_FILE)
    state = _read_json(state_path)
    if not isinstance(state, dict):
      raise ValueError(f"{state_path}: expected a JSON object")
    if state.get("format_version") != _FORMAT_VERSION:
      raise ValueError(f"{state_path}: format_version {state.get('format_version')!r}, expected "
                       f"{_FORMAT_VERSION}")
    add_bos, template = state.get("add_bos", False), state.get("chat_template")
    if not isinstance(add_bos, bool):
      raise ValueError(f"{state_path}: 'add_bos' must be a bool, got {add_bos!r}")
    if template is not None and not isinstance(template, str):
      raise ValueError(f"{state_path}: 'chat_template' must be a string or null")
    tok = _read_tokenizer_json(os.path.join(directory, TOKENIZER_FILE))
    return cls(tok, bos_id=_optional_id(state, "bos_id", state_path),
               eos_id=_optional_id(state, "eos_id", state_path),
               pad_id=_optional_id(state, "pad_id", state_path), add_bos=add_bos,
               chat_template=template)

  def to_json_str(self) -> str:
    """The built `tokenizers.Tokenizer` as `tokenizer.json` text (vocabulary, merges, added
    tokens): what grammar libraries build their token tables from (`kvjax/engine/grammar.py`)."""
    return self._tok.to_str()

  @property
  def bos_id(self) -> int | None:
    """Beginning-of-sequence token id, or None."""
    return self._bos_id

  @property
  def eos_id(self) -> int | None:
    """End-of-sequence token id, or None."""
    return self._eos_id

  @property
  def pad_id(self) -> int | None:
    """Padding token id, or None."""
    return self._pad_id

  @property
  def vocab_size(self) -> int:
    """V: number of token ids, special tokens included."""
    return self._tok.get_vocab_size(with_added_tokens=True)

  def id_to_token(self, token_id: int) -> str | None:
    """Vocabulary string of `token_id` (byte-level, e.g. "Ġthe"), or None when out of range."""
    return self._tok.id_to_token(token_id)

  def encode(self, text: str, add_special_tokens: bool = True, *,
             parse_special: bool = True) -> list[int]:
    """Token ids of `text`.

    Runs without holding the GIL (`tokenizers`' batch encoder), so other Python threads (an
    event loop) keep running while a long text is encoded.

    Args:
      text: any string.
      add_special_tokens: prepend BOS when the model asks for it (`add_bos_token`); a BOS already
        at the start is not doubled.
      parse_special: special tokens written in the text (e.g. "<|im_start|>") map to their ids;
        False: they are plain text, tokenized like any other characters (`tokenizers`'
        `encode_special_tokens`).

    Returns:
      list[int] of ids.

    Raises:
      TypeError: `text` is not a str.
    """
    if not isinstance(text, str):
      raise TypeError(f"text must be a str, got {type(text).__name__}")
    tok = self._tok if parse_special else self._plain_tokenizer()
    ids = tok.encode_batch_fast([text], add_special_tokens=False)[0].ids
    if add_special_tokens and self._add_bos and (not ids or ids[0] != self._bos_id):
      ids = [self._bos_id] + ids
    return ids

  def _plain_tokenizer(self) -> tokenizers.Tokenizer:
    """A copy of the tokenizer that encodes special-token text as plain text (built once)."""
    with self._lock:
      if self._plain_tok is None:
        tok = tokenizers.Tokenizer.from_str(self._tok.to_str())
        tok.encode_special_tokens = True
        self._plain_tok = tok
      return self._plain_tok

  @property
  def max_token_chars(self) -> int:
    """The most characters one token can stand for (the longest vocabulary string, special
    tokens included): a text of n characters needs at least n / max_token_chars tokens."""
    with self._lock:
      if self._max_token_chars is None:
        self._max_token_chars = max(
            (len(t) for t in self._tok.get_vocab(with_added_tokens=True)), default=1)
      return self._max_token_chars

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
    """Text of `ids` (no tokenization-space cleanup, as SmolLM2's `transformers` config).

    Args:
      ids: token ids (any int sequence or 1-D integer array).
      skip_special_tokens: drop special (CONTROL / USER_DEFINED) tokens.

    Returns:
      The text; an id sequence that cuts a UTF-8 character yields U+FFFD for the partial bytes.
    """
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

  def _special_token(self, token_id: int | None) -> str | None:
    return None if token_id is None else self._tok.id_to_token(token_id)

  def apply_chat_template(self, messages: list[dict[str, str]],
                          add_generation_prompt: bool = True) -> str:
    """Renders `messages` with the model's chat template, as `transformers` does.

    Args:
      messages: `[{"role": "user", "content": "Hi"}, ...]`; role and content must be str.
      add_generation_prompt: append the assistant turn's opening.

    Returns:
      The prompt text (special tokens as text).

    Raises:
      ValueError: no chat template, or malformed messages.
      ChatTemplateError: (a ValueError and a jinja2.TemplateError) the template raised
        (`raise_exception`) or failed to render.
    """
    if self.chat_template is None:
      raise ValueError("this tokenizer has no chat template")
    _validate_messages(messages)
    if self._compiled_template is None:
      env = jinja2.sandbox.ImmutableSandboxedEnvironment(
          trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
      env.filters["tojson"] = _tojson
      env.globals["raise_exception"] = _raise_exception
      env.globals["strftime_now"] = _strftime_now
      self._compiled_template = env.from_string(self.chat_template)
    try:
      return self._compiled_template.render(
          messages=messages, add_generation_prompt=add_generation_prompt,
          bos_token=self._special_token(self._bos_id) or "",
          eos_token=self._special_token(self._eos_id) or "",
          pad_token=self._special_token(self._pad_id) or "")
    except ChatTemplateError:
      raise
    except jinja2.exceptions.TemplateError as e:
      raise ChatTemplateError(f"{type(e).__name__}: {e}") from e

  def encode_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True, *,
                  parse_special_in_content: bool = False) -> list[int]:
    """Token ids of the rendered chat prompt (no BOS added beyond what the template writes).

    Only the template emits control tokens: message content is tokenized with special-token text
    as plain text, so content such as "hi<|im_end|>\n<|im_start|>system\nX" stays inside its
    message. Content that cannot form a special token (the usual case) is tokenized with the
    rendered prompt in one piece, exactly as `transformers` does; otherwise the prompt is rendered
    with placeholders for the content and tokenized per segment: the template's text with
    special tokens parsed, each content as plain text.

    Args:
      messages: as for `apply_chat_template`.
      add_generation_prompt: append the assistant turn's opening.
      parse_special_in_content: parse special tokens written in content too (the rendered prompt
        tokenized as one text, as `transformers` does).

    Returns:
      list[int] of ids.

    Raises:
      ValueError: as for `apply_chat_template`; or content with special-token text under a
        template that transforms content other than by `trim` (its segments cannot be told
        apart).
    """
    text = self.apply_chat_template(messages, add_generation_prompt)
    if parse_special_in_content:
      return self.encode(text, add_special_tokens=False)
    return self.encode_chat_suffix(messages, 0, add_generation_prompt=add_generation_prompt,
                                   rendered=text)

  def encode_chat_suffix(self, messages: list[dict[str, str]], start: int, *,
                         add_generation_prompt: bool = True,
                         rendered: str | None = None) -> list[int]:
    """Token ids of the rendered chat prompt from character `start` on, tokenized as
    `encode_chat` tokenizes the whole prompt: special tokens the template writes are control
    tokens, message content is plain text, and no BOS is added. `start=0` is `encode_chat`.

    A session turn's prompt is the previous turn's exact ids followed by this suffix
    (`kvjax.sessions`), so `start` should fall on a boundary between a message's
    content and the template's text.

    Args:
      messages: as for `apply_chat_template`.
      start: offset in characters into the rendered prompt, in [0, len(rendered)].
      add_generation_prompt: append the assistant turn's opening.
      rendered: `apply_chat_template(messages, add_generation_prompt)` when already rendered.

    Returns:
      list[int] of ids (empty when `start` is the end of the prompt).

    Raises:
      ValueError: as for `encode_chat`, or `start` outside the rendered prompt.
    """
    text = (self.apply_chat_template(messages, add_generation_prompt) if rendered is None
            else rendered)
    if not 0 <= start <= len(text):
      raise ValueError(f"start={start} is outside the rendered prompt of {len(text)} characters")
    if not any(self._may_form_special(m["content"])
               or self._may_form_special(m["content"].strip()) for m in messages):
      return self.encode(text[start:], add_special_tokens=False)
    ids: list[int] = []
    pos = 0
    for segment, is_content in self._chat_segments(messages, add_generation_prompt, text):
      end = pos + len(segment)
      if end > start:
        ids += self.encode(segment[max(0, start - pos):], add_special_tokens=False,
                           parse_special=not is_content)
      pos = end
    return ids

  def _may_form_special(self, content: str) -> bool:
    """Whether `content`, alone or with template text around it, could hold a special token."""
    if not content or not self._special_texts:
      return False
    if any(t in content for t in self._special_texts):
      return True
    if any(content in t for t in self._special_texts):
      return True
    return (any(content.endswith(p) for p in self._special_prefixes)
            or any(content.startswith(p) for p in self._special_suffixes))

  def _chat_segments(self, messages: list[dict[str, str]], add_generation_prompt: bool,
                     rendered: str) -> list[tuple[str, bool]]:
    """`rendered` split into (text, is_content) segments, template text and message content.

    Every non-empty content is replaced by a unique placeholder and the template rendered again;
    the placeholder render, its placeholders filled with each content (or the content stripped,
    for templates that `trim`), must give `rendered` back.
    """
    nonce = secrets.token_hex(8)
    masked = [{**m, "content": f"\ue000kvjax-{nonce}-{i}\ue001" if m["content"] else ""}
              for i, m in enumerate(messages)]
    parts = re.split(f"\ue000kvjax-{nonce}-(\\d+)\ue001",
                     self.apply_chat_template(masked, add_generation_prompt))
    # parts: [template, index, template, index, ..., template]
    segments: list[tuple[str, bool]] = []
    pos = 0
    for k in range(0, len(parts), 2):
      template = parts[k]
      if not rendered.startswith(template, pos):
        break
      segments.append((template, False))
      pos += len(template)
      if k + 1 == len(parts):
        if pos == len(rendered):
          return [(t, c) for t, c in segments if t]
        break
      content = messages[int(parts[k + 1])]["content"]
      following = parts[k + 2]
      for candidate in (content, content.strip()):
        if rendered.startswith(candidate + following, pos):
          segments.append((candidate, True))
          pos += len(candidate)
          break
      else:
        break
    raise ValueError("the chat template transforms message content, so content holding "
                     "special-token text cannot be tokenized as plain text")
