"""Chunk keys: chained SHA-256 over token ids, seeded by a key namespace
(`docs/design/storage-format.md`).

A prompt is cut into full chunks of C tokens; chunk i's key hashes chunk i-1's key, its own C
token ids and optional extras (e.g. multimodal content ids):

  root = SHA-256(namespace)        (model fingerprint, KV dtype, layout version, C, cache salt)
  h_0  = SHA-256(root, tokens[0:C], extras)
  h_1  = SHA-256(h_0, tokens[C:2C], extras)
  ...

so a key names the whole prefix up to and including its chunk (the vLLM prefix-caching scheme,
`vllm/v1/core/kv_cache_utils.py` `hash_block_tokens`). Every field is typed and length-prefixed
before hashing, so no two distinct inputs share a byte string: `("ab", "c")` and `("a", "bc")`,
`[]` and `[""]`, `1` and `"1"`, a `None` salt and an empty salt all hash differently. Digests are
hex strings and depend on nothing but the inputs (no `hash()`, so no PYTHONHASHSEED effect).
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
from collections.abc import Sequence

from kvjax import block_hash
from kvjax._typing import ChunkHash

_ROOT_DOMAIN = b"kvjax/chunk-key/root/v1"

# Type tags of encoded fields.
_T_NONE = b"N"
_T_STR = b"S"
_T_BYTES = b"B"
_T_INT = b"I"
_T_LIST = b"L"


def _field(tag: bytes, payload: bytes) -> bytes:
  """One typed field: 1-byte tag, 8-byte big-endian payload length, payload."""
  return tag + struct.pack(">Q", len(payload)) + payload


def _encode_value(value: str | bytes | int | None) -> bytes:
  """Encodes one scalar as a typed, length-prefixed field.

  Raises:
    TypeError: a value that is not None, str, bytes or int (bool is rejected: it is an int
      in Python but almost always a mistake in a key).
  """
  if value is None:
    return _field(_T_NONE, b"")
  if isinstance(value, bool):
    raise TypeError(f"bool is not a valid key field: {value!r}")
  if isinstance(value, str):
    return _field(_T_STR, value.encode("utf-8"))
  if isinstance(value, (bytes, bytearray, memoryview)):
    return _field(_T_BYTES, bytes(value))
  if isinstance(value, int):
    # Signed, minimal-length big-endian two's complement: any size of int is representable.
    n = (value.bit_length() + 8) // 8
    return _field(_T_INT, value.to_bytes(n, "big", signed=True))
  raise TypeError(f"key fields must be str, bytes, int or None, got {type(value).__name__}")


@dataclasses.dataclass(frozen=True)
class KeyNamespace:
  """Everything besides token ids that decides whether stored KV may be reused.

  Attributes:
    model_fingerprint: hex digest of architecture, config and weights.
    kv_dtype: numpy dtype name of the stored KV ("float32", "bfloat16", ...).
    kv_layout_version: version of the `[L, 2, C, K, H]` layout and its conventions (pre-RoPE K).
    chunk_size: C, tokens per chunk.
    cache_salt: tenant isolation salt (vLLM's `cache_salt`); `None` (no salt) differs from `""`.
    encoding: the one encoding ("codec/level", e.g. "kvtc/1") an engine with
      `kv_codec_consistent` stores and loads: its chunks are kept apart from those of other
      encodings (a record is written once, so a chunk stored raw could never gain the encoding
      such an engine needs, and its prompt would be recomputed on every request). None (every
      other engine): chunks of any encoding; the root is then what it was before this field.
  """

  model_fingerprint: str
  kv_dtype: str
  kv_layout_version: int
  chunk_size: int
  cache_salt: str | None = None
  encoding: str | None = None

  def __post_init__(self):
    if self.chunk_size <= 0:
      raise ValueError(f"chunk_size must be positive, got {self.chunk_size}")

  def root_hash(self) -> ChunkHash:
    """The parent hash of a prompt's first chunk; also the namespace id stored in records."""
    h = hashlib.sha256()
    h.update(_field(_T_BYTES, _ROOT_DOMAIN))
    for value in (self.model_fingerprint, self.kv_dtype, self.kv_layout_version, self.chunk_size,
                  self.cache_salt):
      h.update(_encode_value(value))
    if self.encoding is not None:
      h.update(_encode_value(self.encoding))
    return ChunkHash(h.hexdigest())


def hash_chunk(parent: ChunkHash, token_ids: Sequence[int],
               extras: Sequence[str | bytes | int] = ()) -> ChunkHash:
  """Key of one chunk given its parent's key.

  Args:
    parent: hex key of the previous chunk, or the namespace's `root_hash()` for the first chunk.
    token_ids: the chunk's token ids (int64 range).
    extras: further inputs that change the KV (e.g. image content hashes), typed and
      length-prefixed, so `("ab", "c") != ("a", "bc")`, `[] != [""]`, `[1] != ["1"]`.

  Returns:
    Hex SHA-256 digest.

  Raises:
    TypeError: an extra that is not str, bytes or int.
    ValueError: a token id outside int64.
  """
  # One implementation of the chained hash for store chunks and device blocks (a block key equals
  # the chunk key of the same tokens when the block size equals the chunk size).
  return ChunkHash(block_hash.hash_block_tokens(str(parent), token_ids, extras))


def chunk_hashes(namespace: KeyNamespace, token_ids: Sequence[int], *,
                 max_tokens: int | None = None) -> list[ChunkHash]:
  """Keys of the full chunks of `token_ids[:max_tokens]`, chained from the namespace root.

  A partial tail (fewer than C tokens) has no chunk key: a finished session turn's tail is
  stored under its own key (`tail_hash`).

  Args:
    namespace: key namespace; its `chunk_size` is C.
    token_ids: the token ids, from the start of the sequence.
    max_tokens: if given, only the first `max_tokens` tokens are considered.

  Returns:
    `floor(n / C)` hex keys, n = number of tokens considered.
  """
  c = namespace.chunk_size
  ids = list(token_ids if max_tokens is None else token_ids[:max(0, max_tokens)])
  parent = namespace.root_hash()
  out: list[ChunkHash] = []
  for start in range(0, len(ids) - c + 1, c):
    parent = hash_chunk(parent, ids[start:start + c])
    out.append(parent)
  return out


#: The extra field that makes a tail key (`tail_hash`) differ from every chunk key.
TAIL_DOMAIN = b"kvjax/chunk-key/tail/v1"
#: Token id of the padding rows of a stored tail (never a real token id).
TAIL_PAD_ID = -1


def tail_hash(parent: ChunkHash, token_ids: Sequence[int]) -> ChunkHash:
  """Key of a stored tail: the m < C tokens after chunk `parent` that end a finished sequence.

  A session's last partial chunk (its prompt and reply after the last full chunk) is stored
  padded to C rows (`tail_token_ids`) under this key, so the next turn can load it like any
  chunk (CachedAttention, arXiv 2403.19708, section 3.2.2: every historical token's KV). The
  key hashes the parent, the m real token ids and `TAIL_DOMAIN` as an extra, so it can never
  equal a chunk key (whose extras are empty) nor another tail's of other tokens or length.

  Args:
    parent: key of the last full chunk before the tail, or the namespace's `root_hash()`.
    token_ids: the tail's m token ids, 1 <= m.

  Raises:
    ValueError: no token ids, or one outside int64.
  """
  if not len(token_ids):
    raise ValueError("a tail holds at least one token")
  return hash_chunk(parent, token_ids, (TAIL_DOMAIN,))


def tail_token_ids(token_ids: Sequence[int], chunk_size: int) -> tuple[int, ...]:
  """A tail's token ids as its record holds them: the m real ids, then `TAIL_PAD_ID` up to C
  (a stored tail is a chunk of C rows whose last C - m rows are padding).

  Raises:
    ValueError: m outside [1, C).
  """
  m = len(token_ids)
  if not 0 < m < chunk_size:
    raise ValueError(f"a tail holds 1 to {chunk_size - 1} tokens, got {m}")
  return tuple(int(t) for t in token_ids) + (TAIL_PAD_ID,) * (chunk_size - m)


def stored_rows(token_ids: Sequence[int]) -> int:
  """Rows of a chunk's raw values that are stored: its real tokens (`len(token_ids)` for a full
  chunk; m for a tail, whose last C - m ids are `TAIL_PAD_ID`: padding rows are zeros, never
  stored, `chunk_store.ChunkStore`)."""
  n = len(token_ids)
  while n and token_ids[n - 1] == TAIL_PAD_ID:
    n -= 1
  return n


def prefix_chunk_hashes_for_prompt(namespace: KeyNamespace,
                                   prompt_ids: Sequence[int]) -> list[ChunkHash]:
  """Keys of the chunks of a prompt that may be served from the store.

  A hit may never cover the last prompt token: its logits must be computed fresh to sample the
  first output token (`kvjax.block_hash.loadable_units`, the one statement of the rule). So only the full chunks of `prompt_ids[:-1]` are candidates, and a fully
  stored prompt of n tokens yields `C * floor((n - 1) / C)` cached tokens:

    C = 4, n = 8:   [t0 t1 t2 t3][t4 t5 t6 | t7]   -> 1 chunk (4 tokens); t4..t7 computed
    C = 4, n = 9:   [t0 t1 t2 t3][t4 t5 t6 t7] t8  -> 2 chunks (8 tokens); t8 computed

  Args:
    namespace: key namespace; its `chunk_size` is C.
    prompt_ids: the whole prompt's token ids.

  Returns:
    `floor((n - 1) / C)` hex keys (none for an empty prompt).
  """
  c = namespace.chunk_size
  return chunk_hashes(namespace, prompt_ids,
                      max_tokens=block_hash.loadable_units(len(prompt_ids), c) * c)
