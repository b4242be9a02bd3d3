"""Pure functions that build tensorstore specs for the chunk store
(`docs/design/storage-format.md`).

Nothing here opens or touches storage: each function maps arguments to a JSON-able dict, so specs
are easy to test and to log.

URLs understood by `kvstore_spec`:

  memory://            process-local memory (tests); shared by everything using one ts.Context
  memory://name        the same, under the key prefix `name/`
  file:///abs/path     a local directory
  /abs/path, rel/path  the same (a plain path)
  ""                   the default root, ~/.cache/kvjax/store
  ocdbt+file:///abs    an OCDBT database (many small objects in few files) over a local directory
  s3://bucket/prefix   S3 or an S3-compatible server (endpoint/region from kwargs or AWS_* env)
  ocdbt+s3://b/prefix  an OCDBT database over S3 (needs working If-Match PUTs: fine on moto,
                       fails on Ceph RGW 16, see scripts/s3_radosgw_check.sh)

S3 conditional writes: the chunk store publishes a record only if none exists (`if_equal` = the
"no value" generation). tensorstore's s3 driver implements that either with a conditional PUT
(`If-None-Match: *`, `If-Match: <etag>`; spec option `use_conditional_write`) or, its default
for endpoints that are not AWS, with a HEAD request followed by a plain PUT, which is not atomic:
measured on moto, of 8 concurrent creates of one key more than one reported success in 19 of
20 trials. So s3 specs here ask for conditional PUTs (`conditional_write=True`, the default);
`ChunkStore` checks once per store that the server honours them and otherwise falls back (see
its docstring). moto and Ceph RGW 16 both honour `If-None-Match: *`.
"""

from __future__ import annotations

import os
from typing import Any

from kvjax._paths import default_cache_root
from kvjax.storage.format.types import KVLayout


def default_root() -> str:
  """Default root of a local store: `<cache root>/store` (where the server stores by default)."""
  return os.path.join(default_cache_root(), "store")


#: zstd (level 1) inside the shard. Off: measured on [30, 2, 256, 3, 64] chunks (memory kvstore,
#: 2 CPU cores) it shrank float32 values 1.08x and bfloat16 1.28x (the same 1.28x measured
#: on real bf16 KV), while writes got 4-10x and reads 1-8x slower. Real size
#: savings belong to the quantizing codecs.
DEFAULT_ZSTD_LEVEL: int | None = None

# S3: fail instead of hanging when the server is absent or slow.
_S3_RETRIES = {"max_retries": 3, "initial_delay": "100ms", "max_delay": "2s"}
_S3_CONCURRENCY = {"limit": 32}


def _dir_path(path: str) -> str:
  path = os.path.abspath(os.path.expanduser(path))
  return path.rstrip("/") + "/"


def kvstore_spec(url: str, *, endpoint: str | None = None, region: str | None = None,
                 host_header: str | None = None,
                 conditional_write: bool = True) -> dict[str, Any]:
  """Maps a store URL to a tensorstore kvstore spec.

  Args:
    url: see the module docstring for the accepted forms.
    endpoint: S3 endpoint URL (default: `$AWS_ENDPOINT_URL`, else AWS).
    region: S3 region (default: `$AWS_REGION`, else `$AWS_DEFAULT_REGION`, else tensorstore's
      discovery).
    host_header: S3 Host header override (some S3-compatible servers behind proxies need it).
    conditional_write: S3 only: send conditional PUTs (`If-None-Match`/`If-Match`) so that a
      create-if-absent is atomic; False: tensorstore's HEAD-then-PUT, for servers that reject
      conditional PUTs (racy: `ChunkStore` then verifies each publish by reading it back).

  Returns:
    A kvstore spec dict whose `path` (when present) ends with "/".

  Raises:
    ValueError: an unknown scheme (named in the message), or an s3 URL without a bucket.
  """
  if url.startswith("memory://"):
    name = url[len("memory://"):].strip("/")
    spec: dict[str, Any] = {"driver": "memory"}
    if name:
      spec["path"] = name + "/"
    return spec
  if url.startswith("ocdbt+"):
    base = kvstore_spec(url[len("ocdbt+"):], endpoint=endpoint, region=region,
                        host_header=host_header, conditional_write=conditional_write)
    if base["driver"] not in ("file", "s3"):
      raise ValueError(f"ocdbt is supported over file and s3 only, got {url!r}")
    return {"driver": "ocdbt", "base": base}
  if url.startswith("file://"):
    return {"driver": "file", "path": _dir_path(url[len("file://"):] or "/")}
  if url.startswith("s3://"):
    bucket, _, prefix = url[len("s3://"):].partition("/")
    if not bucket:
      raise ValueError(f"s3 URL without a bucket: {url!r}")
    spec = {"driver": "s3", "bucket": bucket, "s3_request_retries": dict(_S3_RETRIES),
            "s3_request_concurrency": dict(_S3_CONCURRENCY),
            "use_conditional_write": bool(conditional_write)}
    prefix = prefix.strip("/")
    if prefix:
      spec["path"] = prefix + "/"
    endpoint = endpoint or os.environ.get("AWS_ENDPOINT_URL")
    region = region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if endpoint:
      spec["endpoint"] = endpoint
    if region:
      spec["aws_region"] = region
    if host_header:
      spec["host_header"] = host_header
    return spec
  if "://" in url:
    raise ValueError(f"unknown store URL scheme {url.split('://', 1)[0]!r} in {url!r}")
  return {"driver": "file", "path": _dir_path(url or default_root())}


def local_dir(url: str) -> str | None:
  """The local directory a store URL names (file://, a path, ocdbt+file://; no trailing "/"),
  or None (memory://, s3://).

  Raises:
    ValueError: as `kvstore_spec`.
  """
  spec = kvstore_spec(url)
  if spec.get("driver") == "ocdbt":
    spec = spec["base"]
  if spec.get("driver") != "file":
    return None
  return spec["path"].rstrip("/") or "/"


def s3_spec(kvstore: dict[str, Any]) -> dict[str, Any] | None:
  """The s3 kvstore spec under `kvstore` (itself, or an ocdbt database's base), else None."""
  while kvstore.get("driver") == "ocdbt":
    kvstore = kvstore["base"]
  return kvstore if kvstore.get("driver") == "s3" else None


def join_path(kvstore: dict[str, Any], key_prefix: str) -> dict[str, Any]:
  """The kvstore spec rooted at `key_prefix` (a "/"-terminated prefix) below `kvstore`'s path."""
  out = dict(kvstore)
  out["path"] = kvstore.get("path", "") + key_prefix
  return out


def chunk_array_spec(kvstore: dict[str, Any], object_key: str, layout: KVLayout, *,
                     create: bool, zstd_level: int | None = DEFAULT_ZSTD_LEVEL) -> dict[str, Any]:
  """A zarr3 array holding one stored chunk's raw values, `[L, 2, C, K, H]` of `layout.dtype`.

  One regular chunk covers the whole array and is sharded (`sharding_indexed`) into inner chunks
  of one layer, `[1, 2, C, K, H]`: the values are one object (`<object_key>/c/0/0/0/0/0`, beside
  `zarr.json`), and one layer can be read alone (shard index + that layer). The shard index
  carries a crc32c, so a truncated or damaged index is detected by tensorstore itself.
  Missing data reads fail (`fill_missing_data_reads: false`) instead of returning zeros.

  Args:
    kvstore: the store's root kvstore spec (from `kvstore_spec`).
    object_key: key prefix of the object below the root, e.g. "data/<hash>/raw-0-<sha>".
    layout: shape and dtype.
    create: True to create (or open an identical existing) array for writing; False to open an
      existing one.
    zstd_level: if set, zstd at this level inside the shard.

  Returns:
    A tensorstore spec dict.
  """
  chunk_shape = list(layout.shape)
  inner_shape = [1] + chunk_shape[1:]
  inner_codecs: list[dict[str, Any]] = [{"name": "bytes", "configuration": {"endian": "little"}}]
  if zstd_level is not None:
    inner_codecs.append({"name": "zstd", "configuration": {"level": int(zstd_level)}})
  spec: dict[str, Any] = {
      "driver": "zarr3",
      "kvstore": join_path(kvstore, object_key.rstrip("/") + "/"),
      "metadata": {
          "shape": chunk_shape,
          "data_type": layout.dtype,
          "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": chunk_shape}},
          "chunk_key_encoding": {"name": "default"},
          "fill_value": 0,
          "codecs": [{
              "name": "sharding_indexed",
              "configuration": {
                  "chunk_shape": inner_shape,
                  "codecs": inner_codecs,
                  "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}},
                                   {"name": "crc32c"}],
                  "index_location": "end",
              },
          }],
      },
      "open": True,
      "fill_missing_data_reads": False,
  }
  if create:
    spec["create"] = True
  return spec
