"""An oracle for vLLM's sha256_cbor block hashes, independent of `kvjax.serve.kv_events`: the
CBOR bytes are written here by hand (RFC 8949, canonical: shortest heads), not by cbor2.

    NONE_HASH = sha256(cbor(seed))                      vLLM `init_none_hash`, PYTHONHASHSEED
    h_i       = sha256(cbor([h_{i-1}, tokens_i, None])) vLLM `hash_block_tokens`
    key_i     = low 64 bits of h_i, big-endian          vLLM's int event hashes; llm-d's keys

This is the reference llm-d-kv-cache's `token_processor_sha256_test.go` computes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence


def cbor_head(major: int, n: int) -> bytes:
  """A CBOR head: major type and argument in the shortest form."""
  if n < 24:
    return bytes([major << 5 | n])
  for info, size in ((24, 1), (25, 2), (26, 4), (27, 8)):
    if n < 1 << (8 * size):
      return bytes([major << 5 | info]) + n.to_bytes(size, "big")
  raise ValueError(f"{n} does not fit a CBOR head")


def none_hash(seed: str) -> bytes:
  """sha256 of the CBOR text string `seed`."""
  raw = seed.encode("utf-8")
  return hashlib.sha256(cbor_head(3, len(raw)) + raw).digest()


def block_keys(token_ids: Sequence[int], seed: str, block_size: int) -> list[int]:
  """Low-64-bit keys of the full blocks of `token_ids` (non-negative ids), chained from
  `none_hash(seed)`."""
  parent = none_hash(seed)
  out = []
  for i in range(0, len(token_ids) - block_size + 1, block_size):
    block = token_ids[i:i + block_size]
    enc = (cbor_head(4, 3) + cbor_head(2, 32) + parent + cbor_head(4, len(block))
           + b"".join(cbor_head(0, int(t)) for t in block) + b"\xf6")
    parent = hashlib.sha256(enc).digest()
    out.append(int.from_bytes(parent[-8:], "big"))
  return out
