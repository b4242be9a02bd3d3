"""Dimension key and identifier types shared by every room of kvjax.

Tensors carry their axes as a suffix (``q_BTNH``, ``k_cache_LBSKH``) and einsum strings use the same
letters:

  B  batch (requests or decode slots)     T  query tokens in this step
  S  key/value tokens (cache positions)   D  model width
  N  query heads                          K  key/value heads
  G  query heads per key/value head       H  head dimension
  F  MLP hidden width                     V  vocabulary
  L  layers                               C  tokens in a stored chunk
"""

from __future__ import annotations

from typing import NewType

#: Hex SHA-256 of a chunk of tokens chained through its parent (storage keys).
ChunkHash = NewType("ChunkHash", str)
#: Caller-visible identifier of one request.
RequestId = NewType("RequestId", str)
#: Hex digest identifying a model's architecture, config and weights.
ModelFingerprint = NewType("ModelFingerprint", str)
