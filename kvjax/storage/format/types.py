"""Plain records shared by the store, its tiers and the engine (numpy only, no JAX).

A stored chunk is C tokens of KV for all layers, `[L, 2, C, K, H]` (K before RoPE, then V), plus
an index record that says which tokens it holds, under which key namespace, in which layout, and
which encodings of it exist (`docs/design/storage-format.md`). The codec is not part of the key: a
reader picks any encoding it can decode.

The stored-chunk guard: a record also names what wrote it (`ChunkOrigin`: the model fingerprint
and the stored layout's version), and every reader checks the record's own model, layout version,
dtype, chunk size and shape (`ChunkRecord.mismatch`) and each encoding's codec version (the
record's and the payload header's) before using a byte, so a chunk that lands under the right key
with another setting's contents is a miss with its own reason, never decoded.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from kvjax._typing import ChunkHash

#: Version of the index record's JSON format written now. 3: a raw encoding also lists one
#: checksum per layer (`Encoding.layer_checksums`), so a read of layers `[k, L)` reads and
#: verifies those layers' bytes alone; 2 (still read, whole): each encoding names its checksum
#: algorithm (`checksum_algo`); 1 (still read, whole): no such field, every checksum is SHA-256.
RECORD_FORMAT_VERSION = 3
#: Record formats this reader parses.
READABLE_RECORD_FORMATS = (1, 2, 3)


@dataclasses.dataclass(frozen=True)
class KVLayout:
  """Shape and dtype a stored chunk must have to be used: `[L, 2, C, K, H]` of `dtype`.

  Attributes:
    num_layers: L.
    chunk_size: C, tokens.
    num_kv_heads: K.
    head_dim: H.
    dtype: numpy dtype name of the raw values ("float32", "bfloat16", ...).
  """

  num_layers: int
  chunk_size: int
  num_kv_heads: int
  head_dim: int
  dtype: str

  @property
  def shape(self) -> tuple[int, int, int, int, int]:
    return (self.num_layers, 2, self.chunk_size, self.num_kv_heads, self.head_dim)

  @property
  def nbytes(self) -> int:
    """Bytes of one raw chunk."""
    import ml_dtypes  # noqa: F401, PLC0415  (registers bfloat16 with numpy)
    return int(np.prod(self.shape)) * np.dtype(self.dtype).itemsize


@dataclasses.dataclass(frozen=True)
class Encoding:
  """One stored encoding of a chunk.

  Attributes:
    codec: codec id ("raw", "int8", "int4", "cachegen"; see `storage.format.codecs`).
    codec_version: version of that codec's byte format.
    level: encoding level (CacheGen levels, 0 the finest; 0 for the others).
    object: key of the data object, relative to the store root (a zarr3 array's key prefix for
      raw, one key holding the encoded bytes for the other codecs).
    nbytes: stored bytes: the raw values' bytes, or the length of the encoded object.
    checksum: hex digest (`checksum_algo`) of the raw values' bytes (C order), or of the encoded
      object's bytes (verified before decoding). The host tier, which keeps arrays, not bytes,
      records `codecs.payload_checksum` of the arrays. It catches corruption; identity is the
      key's job (see `storage.format.checksum`).
    checksum_algo: "xxh3-128" (written now) or "sha256" (record format 1).
    layer_checksums: raw encodings of record format 3: L hex digests (`checksum_algo`), layer
      l's of the object's bytes `[l * nbytes / L, (l + 1) * nbytes / L)` (the C-order bytes of
      `values[l]`, `[2, C, K, H]`, or a stored tail's `[2, m, K, H]`), so a layer range reads
      and verifies alone. Empty for other codecs, the host tier's records and older formats
      (a read of a layer range then reads the whole object).
  """

  codec: str
  codec_version: int
  level: int
  object: str
  nbytes: int
  checksum: str
  checksum_algo: str = "xxh3-128"
  layer_checksums: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class ChunkOrigin:
  """What wrote a chunk besides its tokens and layout: stored in its record, checked field by
  field on every read (a key hashes these too, but a chunk can land under a key it does not
  belong to: a writer that keyed it without one of them, a copied store).

  Attributes:
    model_fingerprint: hex digest of the model's architecture, config and weights
      (`kvjax.models.loading.fingerprint`).
    kv_layout_version: version of the stored `[L, 2, C, K, H]` layout and its conventions
      (`kvjax.models.nn.kv_cache.KV_LAYOUT_VERSION`: K before RoPE). The device pool's own layout
      (`PoolLayout`: heads folded, lanes padded, shards) is not stored: a chunk is unfolded
      before it is saved, so it is the same for every pool layout.
  """

  model_fingerprint: str
  kv_layout_version: int


#: Picks which of a record's decodable encodings to read (None: none of them). It gets them in
#: record order and must return one of them.
Chooser = Callable[[Sequence[Encoding]], "Encoding | None"]


class RecordFormatError(ValueError):
  """A record of a format version this reader cannot read (`READABLE_RECORD_FORMATS`)."""


@dataclasses.dataclass(frozen=True)
class ChunkRecord:
  """The index record of a stored chunk; written last, after its data (commit last).

  Attributes:
    chunk_hash: the chunk's key.
    parent_hash: key of the previous chunk (the namespace root for the first chunk).
    token_ids: the C token ids the KV belongs to (checked on every read).
    namespace: hex root hash of the key namespace (model fingerprint, dtype, layout version,
      chunk size, cache salt).
    layout: shape and dtype of the raw values.
    encodings: stored encodings, any of which a reader may use.
    format_version: `RECORD_FORMAT_VERSION` when written; a parsed format 1 record keeps 1.
    origin: the model and layout version that wrote it, or None (records written before the
      guard, and writers that give none: such a record is checked by its namespace only). An
      optional JSON field ("origin"): readers that predate it ignore it.
  """

  chunk_hash: ChunkHash
  parent_hash: ChunkHash
  token_ids: tuple[int, ...]
  namespace: str
  layout: KVLayout
  encodings: tuple[Encoding, ...]
  format_version: int = RECORD_FORMAT_VERSION
  origin: ChunkOrigin | None = None

  def mismatch(self, token_ids: tuple[int, ...], namespace: str, layout: KVLayout,
               origin: ChunkOrigin | None = None) -> ChunkMiss | None:
    """The miss a reader must report if this record is not the chunk it asked for, else None.

    Every tier checks the same things, in this order, each from the record's own fields (not
    from the key it was found under): the model (`origin`, when both the reader and the record
    name one; MODEL_MISMATCH), the layout version (LAYOUT_MISMATCH), the dtype
    (DTYPE_MISMATCH), the chunk size (CHUNK_SIZE_MISMATCH), the rest of the layout's shape
    (LAYOUT_MISMATCH), the token ids (TOKEN_MISMATCH), the namespace (NAMESPACE_MISMATCH: the
    cache salt, a consistent engine's encoding, and everything else for a record without an
    origin). Codec versions are checked per encoding by the tier that decodes it
    (CODEC_VERSION_MISMATCH).
    """
    def miss(reason: MissReason, detail: str) -> ChunkMiss:
      return ChunkMiss(self.chunk_hash, reason, detail)

    if origin is not None and self.origin is not None:
      if self.origin.model_fingerprint != origin.model_fingerprint:
        return miss(MissReason.MODEL_MISMATCH, f"stored by model {self.origin.model_fingerprint}, "
                    f"want {origin.model_fingerprint}")
      if self.origin.kv_layout_version != origin.kv_layout_version:
        return miss(MissReason.LAYOUT_MISMATCH, f"stored layout version "
                    f"{self.origin.kv_layout_version}, want {origin.kv_layout_version}")
    if self.layout.dtype != layout.dtype:
      return miss(MissReason.DTYPE_MISMATCH, f"stored {self.layout.dtype}, want {layout.dtype}")
    if self.layout.chunk_size != layout.chunk_size:
      return miss(MissReason.CHUNK_SIZE_MISMATCH,
                  f"stored C={self.layout.chunk_size}, want C={layout.chunk_size}")
    if self.layout != layout:
      return miss(MissReason.LAYOUT_MISMATCH, f"stored {self.layout}")
    if self.token_ids != token_ids:
      return miss(MissReason.TOKEN_MISMATCH, "")
    if self.namespace != namespace:
      return miss(MissReason.NAMESPACE_MISMATCH, self.namespace)
    return None

  def to_json(self) -> bytes:
    """The record as JSON, in its own `format_version` (format 1: no `checksum_algo`; formats
    1 and 2: no `layer_checksums`, format 3: only on encodings that have them; no "origin" key
    when `origin` is None).

    Raises:
      ValueError: `layer_checksums` in a record of format 1 or 2.
    """
    d = dataclasses.asdict(self)
    if d["origin"] is None:
      del d["origin"]
    for e in d["encodings"]:
      if e["layer_checksums"] and self.format_version < 3:
        raise ValueError(f"record format {self.format_version} has no layer checksums")
      if not e["layer_checksums"]:
        del e["layer_checksums"]
      if self.format_version == 1:
        del e["checksum_algo"]
    return json.dumps(d, sort_keys=True).encode()

  @classmethod
  def from_json(cls, data: bytes) -> "ChunkRecord":
    """Parses a record.

    Raises:
      RecordFormatError: another integer format version (a ValueError).
      ValueError: malformed JSON, no integer format version, missing or mistyped fields.
    """
    try:
      d: dict[str, Any] = json.loads(data)
      version = d.get("format_version")
      if version not in READABLE_RECORD_FORMATS:
        message = f"record format {version!r}, want one of {READABLE_RECORD_FORMATS}"
        if isinstance(version, int) and not isinstance(version, bool):
          raise RecordFormatError(message)
        raise ValueError(message)
      if version < 3 and any("layer_checksums" in e for e in d["encodings"]):
        raise ValueError(f"record format {version} encoding with layer_checksums")
      if version == 1:  # No checksum_algo field: SHA-256 throughout.
        encodings = tuple(Encoding(**e, checksum_algo="sha256") for e in d["encodings"])
      else:
        encodings = tuple(Encoding(**{**e, "layer_checksums": tuple(
            str(c) for c in e.get("layer_checksums", ()))}) for e in d["encodings"])
        if any("checksum_algo" not in e for e in d["encodings"]):
          raise ValueError(f"record format {version} encoding without checksum_algo")
      return cls(
          chunk_hash=ChunkHash(str(d["chunk_hash"])), parent_hash=ChunkHash(str(d["parent_hash"])),
          token_ids=tuple(int(t) for t in d["token_ids"]), namespace=str(d["namespace"]),
          layout=KVLayout(**d["layout"]), encodings=encodings, format_version=int(version),
          origin=(ChunkOrigin(model_fingerprint=str(d["origin"]["model_fingerprint"]),
                              kv_layout_version=int(d["origin"]["kv_layout_version"]))
                  if d.get("origin") is not None else None))
    except (KeyError, TypeError, AttributeError, json.JSONDecodeError, UnicodeDecodeError) as e:
      raise ValueError(f"malformed chunk record: {e!r}") from e

  @classmethod
  def is_malformed(cls, data: bytes) -> bool:
    """Whether `data` is no record of any format version: not a JSON object, no integer
    `format_version`, or a readable version with missing or mistyped fields (a torn or
    overwritten record). A record of another integer format version is not malformed: a newer
    writer's, left alone."""
    try:
      cls.from_json(data)
    except RecordFormatError:
      return False
    except ValueError:
      return True
    return False


class MissReason(str, enum.Enum):
  """Why a lookup or read did not produce usable KV (counted per reason)."""

  ABSENT = "absent"                      # no index record
  TOKEN_MISMATCH = "token_mismatch"      # record holds other token ids
  NAMESPACE_MISMATCH = "namespace_mismatch"  # another salt or consistent encoding (or, record
                                             # without an origin: model, dtype, layout, C)
  MODEL_MISMATCH = "model_mismatch"      # written by another model (`ChunkOrigin`)
  LAYOUT_MISMATCH = "layout_mismatch"    # another layout version, or shape [L, 2, C, K, H]
  DTYPE_MISMATCH = "dtype_mismatch"      # another KV dtype
  CHUNK_SIZE_MISMATCH = "chunk_size_mismatch"  # another C
  CODEC_VERSION_MISMATCH = "codec_version_mismatch"  # a codec this reader knows, at another
                                                     # version (record or payload header)
  UNKNOWN_CODEC = "unknown_codec"        # no encoding this reader can decode
  MISSING_DATA = "missing_data"          # record present, data object gone
  CHECKSUM_MISMATCH = "checksum_mismatch"
  CORRUPT = "corrupt"                    # unreadable, truncated or malformed record or data
  READ_ERROR = "read_error"              # the backend failed (timeout, unreachable)


@dataclasses.dataclass(frozen=True, eq=False)
class EncodedPayload:
  """One encoding of a chunk to store: a codec's arrays (`storage.format.codecs.payload_spec`).

  Attributes:
    codec: codec id ("raw", "int8", "int4", "cachegen").
    level: its level.
    arrays: {name: array} as the codec contract lists them (raw: {"values": kv}).
  """

  codec: str
  level: int
  arrays: Mapping[str, np.ndarray]


@dataclasses.dataclass(frozen=True, eq=False)
class ChunkHit:
  """A verified chunk, or (a read of a layer range) its layers `[layer_start, L)`.

  Attributes:
    record: its index record.
    encoding: the encoding that was read.
    kv: raw hits: `[L - layer_start, 2, C, K, H]` values in `record.layout.dtype`, K before
      RoPE (layers `[layer_start, L)`; all L when `layer_start` is 0); None for the other
      codecs (decode `payload` with the kernels' `kv_decode`).
    tier: name of the tier it came from.
    payload: the encoding's arrays, bit-exact as stored (raw: {"values": kv}). Defaults to
      {"values": kv} when only `kv` is given. An array of a device coding (kvtc's "rans-bands"
      `q`) is an `entropy.RansCodes` (parsed and verified, not decoded; `codecs.DEVICE_CODINGS`).
    layer_start: the first layer `kv` holds: 0, or k > 0 for a raw read of layers `[k, L)`
      (`get(..., layer_start=k)`; other codecs are read whole and keep 0).
    nbytes: stored bytes the read moved: `encoding.nbytes` (the default, -1, becomes it), or a
      layer range's `encoding.nbytes * (L - k) / L` when only those layers were read.
  """

  record: ChunkRecord
  encoding: Encoding
  kv: np.ndarray | None
  tier: str
  payload: Mapping[str, np.ndarray] = dataclasses.field(default_factory=dict)
  layer_start: int = 0
  nbytes: int = -1

  def __post_init__(self):
    if not self.payload and self.kv is not None:
      object.__setattr__(self, "payload", {"values": self.kv})
    if self.nbytes < 0:
      object.__setattr__(self, "nbytes", int(self.encoding.nbytes))

  def from_layer(self, layer_start: int, nbytes: int) -> "ChunkHit":
    """This whole raw hit's layers `[layer_start, L)` (a view of `kv`), read as `nbytes`.

    Raises:
      ValueError: not a whole raw hit, or `layer_start` not in `[0, L)`.
    """
    if self.kv is None or self.layer_start:
      raise ValueError("only a whole raw hit has layers to slice")
    if not 0 <= layer_start < self.kv.shape[0]:
      raise ValueError(f"layer_start {layer_start} of {self.kv.shape[0]} layers")
    kv = self.kv[layer_start:]
    return ChunkHit(self.record, self.encoding, kv, self.tier, {"values": kv}, layer_start,
                    int(nbytes))


@dataclasses.dataclass(frozen=True)
class ChunkMiss:
  """A chunk that cannot be used, and why."""

  chunk_hash: ChunkHash
  reason: MissReason
  detail: str = ""
