"""Block keys: chained SHA-256 over the token ids of device KV blocks (a bottom-floor module).

The device pool holds KV in blocks of `B` tokens (`block_size`); the store holds it in chunks of
`C` tokens (`kv_chunk_size`), and a chunk always spans a whole number `R = C / B` of blocks. Both
are keyed by the same chained scheme (vLLM's prefix caching, `vllm/v1/core/kv_cache_utils.py`
`hash_block_tokens`; the store's `kvjax.storage.format.keys`), seeded by the same namespace root, so
`cache_salt` and the model namespace isolate device hits exactly as they isolate stored ones (the
encoding is there only for a `kv_codec_consistent` engine, whose blocks hold its codec's KV):

  root = KeyNamespace(model fingerprint, kv dtype, layout version, C, cache salt[,
                      encoding]).root_hash()
  block key  b_i = H(b_{i-1}, tokens[iB : (i+1)B])      b_{-1} = root
  chunk key  c_j = H(c_{j-1}, tokens[jC : (j+1)C])      c_{-1} = root

with the same hash function `H` (`hash_block_tokens` here is byte for byte the store's
`hash_chunk`; a test holds them equal). Either key names the whole prefix up to the end of its
block or chunk. So with `B = C` block keys ARE chunk keys; with `B < C` they are different digests
of the same prefixes, mapped by position:

  tokens    0         B         2B        3B        4B        5B        6B
  blocks    [  b_0   ][  b_1   ][  b_2   ][  b_3   ][  b_4   ][  b_5   ]      B = C / 2, R = 2
  chunks    [       c_0        ][       c_1        ][       c_2        ]

  block i lies in chunk  i // R                    (`chunk_of_block`)
  chunk j is blocks      [jR, (j+1)R)              (`blocks_of_chunk`)
  c_j and b_{(j+1)R-1} name the same prefix        (two prompts agree on one iff on the other)

Device hits are block-granular (a prefix of `m` blocks covers `m * B` tokens); store hits are
chunk-granular. A device hit of `m` blocks makes chunks `[0, m // R)` resident from the start
(`full_chunks_in_blocks`); the store is asked only for the chunks after them.

Every field is typed and length-prefixed before hashing (`("ab", "c") != ("a", "bc")`), digests
are hex strings, and nothing depends on Python's `hash()`. This module imports only the standard
library so the scheduler room (which may not import `kvjax.storage`) and the storage room can both
use it.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import NewType

#: Hex SHA-256 of a block of tokens chained through its parent (device prefix-cache keys). Equal
#: to the store's `ChunkHash` of the same prefix when the block size equals the chunk size.
BlockHash = NewType("BlockHash", str)

# Must stay equal to kvjax/storage/format/keys.py: with B = C a block key is the chunk key.
_CHUNK_DOMAIN = b"kvjax/chunk-key/chunk/v1"
_T_STR = b"S"
_T_BYTES = b"B"
_T_INT = b"I"
_T_TOKENS = b"T"
_T_LIST = b"L"


def _field(tag: bytes, payload: bytes) -> bytes:
  """One typed field: 1-byte tag, 8-byte big-endian payload length, payload."""
  return tag + struct.pack(">Q", len(payload)) + payload


def _encode_extra(value: str | bytes | int) -> bytes:
  if isinstance(value, bool):
    raise TypeError(f"bool is not a valid key field: {value!r}")
  if isinstance(value, str):
    return _field(_T_STR, value.encode("utf-8"))
  if isinstance(value, (bytes, bytearray, memoryview)):
    return _field(_T_BYTES, bytes(value))
  if isinstance(value, int):
    n = (value.bit_length() + 8) // 8
    return _field(_T_INT, value.to_bytes(n, "big", signed=True))
  raise TypeError(f"key extras must be str, bytes or int, got {type(value).__name__}")


def hash_block_tokens(parent: str, token_ids: Sequence[int],
                      extras: Sequence[str | bytes | int] = ()) -> BlockHash:
  """Key of one block (or chunk) of tokens given its parent's key.

  Args:
    parent: hex key of the previous block, or the namespace root for the first block.
    token_ids: the block's token ids (int64 range).
    extras: further inputs that change the KV (e.g. image content hashes).

  Returns:
    Hex SHA-256 digest, identical to `kvjax.storage.format.keys.hash_chunk(parent, token_ids, extras)`.

  Raises:
    TypeError: a parent that is not a str, or an extra that is not str, bytes or int.
    ValueError: a token id outside int64.
  """
  if not isinstance(parent, str):
    raise TypeError(f"parent must be a hex str key, got {type(parent).__name__}")
  ids = [int(t) for t in token_ids]
  try:
    tokens = struct.pack(f"<{len(ids)}q", *ids)
  except struct.error as e:
    raise ValueError(f"token id out of int64 range: {e}") from e
  h = hashlib.sha256()
  h.update(_field(_T_BYTES, _CHUNK_DOMAIN))
  h.update(_field(_T_STR, parent.encode("utf-8")))
  h.update(_field(_T_TOKENS, struct.pack(">Q", len(ids)) + tokens))
  encoded = b"".join(_encode_extra(e) for e in extras)
  h.update(_field(_T_LIST, struct.pack(">Q", len(extras)) + encoded))
  return BlockHash(h.hexdigest())


def block_hashes(namespace_root: str, token_ids: Sequence[int], block_size: int, *,
                 max_tokens: int | None = None) -> list[BlockHash]:
  """Keys of the full blocks of `token_ids[:max_tokens]`, chained from `namespace_root`.

  A partial tail (fewer than `block_size` tokens) has no key.

  Args:
    namespace_root: the key namespace's root hash (`KeyNamespace.root_hash()`: model fingerprint,
      kv dtype, layout version, chunk size, cache salt), a hex str.
    token_ids: token ids from the start of the sequence.
    block_size: B, tokens per block.
    max_tokens: if given, only the first `max_tokens` tokens are considered.

  Returns:
    `floor(n / B)` hex keys, n = number of tokens considered.

  Raises:
    ValueError: `block_size` not positive, or a token id outside int64.
  """
  if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
    raise ValueError(f"block_size must be a positive int, got {block_size!r}")
  ids = token_ids if max_tokens is None else token_ids[:max(0, max_tokens)]
  parent = namespace_root
  out: list[BlockHash] = []
  for start in range(0, len(ids) - block_size + 1, block_size):
    parent = hash_block_tokens(parent, ids[start:start + block_size])
    out.append(parent)
  return out


def loadable_units(num_tokens: int, unit_tokens: int) -> int:
  """Whole units of `unit_tokens` (store chunks of C, device blocks of B) a prefix hit of an
  n-token prompt may cover: `floor((n - 1) / unit)`, 0 for an empty prompt.

  The last-token rule, stated once: a hit never covers the prompt's last token, whose logits
  must be computed to sample the first output token (so a fully stored prompt still computes
  at least one token). The store's candidate chunks (`kvjax.storage.format.keys`,
  `kvjax.connector.lookup`), the device prefix cache (`kvjax.scheduler.kv_cache_manager`), a
  Cake merge's prefix (`kvjax.scheduler.cake`) and re-rotated session KV
  (`kvjax.engine.rerotation`) all take their bound from here:

    C = 4, n = 8:   [t0 t1 t2 t3][t4 t5 t6 | t7]   -> 1 unit; t4..t7 computed
    C = 4, n = 9:   [t0 t1 t2 t3][t4 t5 t6 t7] t8  -> 2 units; t8 computed
  """
  return max(0, (num_tokens - 1) // unit_tokens)


def blocks_per_chunk(block_size: int, chunk_size: int) -> int:
  """R = C / B, the blocks one store chunk spans.

  Raises:
    ValueError: either size not positive, or C not a whole multiple of B.
  """
  for name, v in (("block_size", block_size), ("chunk_size", chunk_size)):
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
      raise ValueError(f"{name} must be a positive int, got {v!r}")
  if chunk_size % block_size:
    raise ValueError(f"kv_chunk_size={chunk_size} must be a whole number of blocks of "
                     f"block_size={block_size} (a store chunk spans whole blocks)")
  return chunk_size // block_size


def chunk_of_block(block_index: int, block_size: int, chunk_size: int) -> int:
  """Index of the store chunk that contains block `block_index` (`i // R`).

  Raises:
    ValueError: bad sizes (see `blocks_per_chunk`) or a negative index.
  """
  r = blocks_per_chunk(block_size, chunk_size)
  if block_index < 0:
    raise ValueError(f"block_index must be >= 0, got {block_index}")
  return block_index // r


def blocks_of_chunk(chunk_index: int, block_size: int, chunk_size: int) -> range:
  """Block indices `[jR, (j+1)R)` of store chunk `chunk_index`; the last one's key names the
  same prefix as the chunk's key.

  Raises:
    ValueError: bad sizes (see `blocks_per_chunk`) or a negative index.
  """
  r = blocks_per_chunk(block_size, chunk_size)
  if chunk_index < 0:
    raise ValueError(f"chunk_index must be >= 0, got {chunk_index}")
  return range(chunk_index * r, (chunk_index + 1) * r)


def full_chunks_in_blocks(num_blocks: int, block_size: int, chunk_size: int) -> int:
  """Store chunks wholly covered by a device prefix of `num_blocks` blocks (`m // R`).

  Raises:
    ValueError: bad sizes (see `blocks_per_chunk`) or a negative count.
  """
  r = blocks_per_chunk(block_size, chunk_size)
  if num_blocks < 0:
    raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
  return num_blocks // r
