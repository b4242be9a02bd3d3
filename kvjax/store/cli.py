"""Operator commands over a chunk store: `ls`, `du`, `verify`, `gc` (`python -m kvjax.store`).

    python -m kvjax.store ls     [--store URL] [--namespace PREFIX] [--json]
    python -m kvjax.store du     [--store URL] [--namespace PREFIX] [--json]
    python -m kvjax.store verify [--store URL] [--namespace PREFIX] [--json] [--delete_bad]
    python -m kvjax.store gc     [--store URL] [--json] [--dry_run]

Exit status: 0 fine, 1 `verify` found bad chunks, 2 usage error or the store could not be opened
or read (one line on stderr, no traceback).

The library half (`scan`, `disk_usage`, `verify`, `find_orphans`, `collect_garbage`) takes an
open `ChunkStore` and returns plain records, through the store's own maintenance API
(`ChunkStore.scan`, `orphans`, `verify`, `gc`, `delete`, `local_dir`: the key layout stays the
store's business); `main` parses absl flags into a fresh `FlagValues` per call (so tests can call
it in-process), runs one command and prints.

What each command reads:
- ls / du: the index (`index/*.json`), never data; du also lists data keys (orphans) and, for
  file and ocdbt+file stores, walks the directory for bytes on disk.
- verify: every encoding of every selected chunk through `ChunkStore.verify` (`get` with the
  record's own token ids, namespace and layout), i.e. the same checks a server makes (tokens,
  namespace, layout, codec, size, the checksum of the stored bytes (xxh3-128; SHA-256 in
  record format 1 stores), and a full decode of each codec payload). A chunk is bad if any encoding this reader knows is bad, or if it
  knows none (UNKNOWN_CODEC, kept by --delete_bad). A malformed record is bad as CORRUPT.
- gc: `ChunkStore.gc`. A writer in another process can lose an object it is still writing; that
  chunk then reads as MISSING_DATA, never as wrong data, so run gc when writers are quiet.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from absl import flags

from kvjax.storage.format import keys
from kvjax.storage.backends import specs
from kvjax.storage.backends.chunk_store import ChunkStore, DataObject, StoreIndex
from kvjax.storage.format.types import ChunkRecord, MissReason

COMMANDS = ("ls", "du", "verify", "gc")
EXIT_OK, EXIT_BAD, EXIT_ERROR = 0, 1, 2
#: Characters of a hash shown by `ls`.
SHORT = 12
#: Reasons `verify --delete_bad` leaves alone: the chunk may be fine (a transient backend error,
#: or a codec or codec version newer than this reader).
KEEP_REASONS = frozenset({MissReason.READ_ERROR, MissReason.UNKNOWN_CODEC,
                          MissReason.CODEC_VERSION_MISMATCH})

class StoreError(Exception):
  """The store cannot be opened or read; the message is one line for the operator."""


#: The store's index (`ChunkStore.scan`) and an unreferenced data object (`ChunkStore.orphans`).
Scan = StoreIndex
Orphan = DataObject


@dataclasses.dataclass(frozen=True)
class Usage:
  """Totals of `du`.

  Attributes:
    records: parseable index records (after the namespace filter).
    malformed_records: index records that do not parse (not filtered: no namespace known).
    chunks_per_namespace: full namespace id -> records.
    stored_bytes: stored bytes of all encodings of the records (`Encoding.nbytes`: raw values'
      bytes, or the encoded objects' lengths).
    orphans: data objects no record references (what `gc` would remove), whole store.
    orphan_bytes: bytes of those objects' keys.
    disk_files: files under the store directory (file backends; None otherwise).
    disk_bytes: their apparent size, bytes (None when not a file backend).
    disk_allocated_bytes: their allocated size (`st_blocks * 512`), bytes, like `du`.
    stored_bytes_per_codec: "codec/level" -> stored bytes of those encodings.
  """

  records: int
  malformed_records: int
  chunks_per_namespace: dict[str, int]
  stored_bytes: int
  orphans: int
  orphan_bytes: int
  disk_files: int | None
  disk_bytes: int | None
  disk_allocated_bytes: int | None
  stored_bytes_per_codec: dict[str, int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class BadChunk:
  """A chunk that did not verify.

  Attributes:
    chunk_hash: full hash.
    reason: why (`MissReason`).
    detail: the store's detail string (may be empty).
    deleted: whether `verify --delete_bad` removed its record and data.
  """

  chunk_hash: str
  reason: MissReason
  detail: str
  deleted: bool = False


async def open_store(store: ChunkStore) -> None:
  """Opens the store, failing on a missing directory instead of reading it as empty.

  Raises:
    StoreError: the directory of a local store does not exist, or the backend failed.
  """
  path = store.local_dir()
  if path is not None and not os.path.isdir(path):
    raise StoreError(f"no store at {store.url!r}: directory {path} does not exist")
  try:
    await store.kvstore()
  except Exception as e:  # noqa: BLE001
    raise StoreError(f"cannot open store {store.url!r}: {_one_line(e)}") from e


def _one_line(e: BaseException | str) -> str:
  """First line of an error message (tensorstore's run to several)."""
  text = str(e).strip().splitlines()
  if text:
    return text[0]
  return "" if isinstance(e, str) else type(e).__name__


async def scan(store: ChunkStore, namespace: str = "") -> Scan:
  """Reads every index record (`ChunkStore.scan`).

  Args:
    store: an open store.
    namespace: keep only records whose namespace id starts with this (hex) prefix.

  Returns:
    The records and the malformed ones (malformed ones are kept whatever the filter).

  Raises:
    StoreError: listing or reading the index failed.
  """
  try:
    return await store.scan(namespace)
  except Exception as e:  # noqa: BLE001
    raise StoreError(f"cannot read the index of {store.url!r}: {_one_line(e)}") from e


async def find_orphans(store: ChunkStore, found: Scan | None = None) -> list[Orphan]:
  """Data objects that no record references (`ChunkStore.orphans`: what `gc` removes).

  Args:
    store: an open store.
    found: an unfiltered `scan(store)` to reuse, else one is made.

  Raises:
    StoreError: listing or reading the store failed.
  """
  found = found if found is not None else await scan(store)
  try:
    return await store.orphans(found)
  except Exception as e:  # noqa: BLE001
    raise StoreError(f"cannot list the data of {store.url!r}: {_one_line(e)}") from e


def _walk_dir(path: str) -> tuple[int, int, int]:
  """(files, apparent bytes, allocated bytes) under `path`."""
  files = nbytes = allocated = 0
  for dirpath, _, names in os.walk(path):
    for name in names:
      try:
        st = os.stat(os.path.join(dirpath, name), follow_symlinks=False)
      except OSError:
        continue
      files += 1
      nbytes += st.st_size
      allocated += st.st_blocks * 512
  return files, nbytes, allocated


async def disk_usage(store: ChunkStore, namespace: str = "") -> Usage:
  """Totals over the index, orphaned data objects and (for local stores) the directory."""
  everything = await scan(store)
  found = Scan(tuple(r for r in everything.records if r.namespace.startswith(namespace)),
               everything.malformed)
  per_ns = collections.Counter(r.namespace for r in found.records)
  orphans = await find_orphans(store, everything)
  path = store.local_dir()
  files, nbytes, allocated = _walk_dir(path) if path is not None else (None, None, None)
  per_codec = collections.Counter()
  for r in found.records:
    for e in r.encodings:
      per_codec[f"{e.codec}/{e.level}"] += e.nbytes
  return Usage(
      records=len(found.records), malformed_records=len(found.malformed),
      chunks_per_namespace=dict(sorted(per_ns.items())),
      stored_bytes=sum(e.nbytes for r in found.records for e in r.encodings),
      orphans=len(orphans), orphan_bytes=sum(o.nbytes for o in orphans),
      disk_files=files, disk_bytes=nbytes, disk_allocated_bytes=allocated,
      stored_bytes_per_codec=dict(sorted(per_codec.items())))


async def verify(store: ChunkStore, namespace: str = "", *, delete_bad: bool = False,
                 concurrency: int = 8) -> tuple[int, list[BadChunk]]:
  """Reads back every selected chunk (`ChunkStore.verify`) and collects the bad ones.

  Args:
    store: an open store.
    namespace: namespace id prefix filter.
    delete_bad: remove the record and data of bad chunks (not those in `KEEP_REASONS`).
    concurrency: chunks read at once (the store's byte limiter bounds bytes too).

  Returns:
    (chunks checked, bad chunks sorted by hash).
  """
  found = await scan(store, namespace)
  sem = asyncio.Semaphore(max(1, concurrency))

  async def check(record: ChunkRecord) -> BadChunk | None:
    async with sem:
      miss = await store.verify(record)
    return None if miss is None else BadChunk(record.chunk_hash, miss.reason, miss.detail)

  results = await asyncio.gather(*(check(r) for r in found.records))
  bad = [b for b in results if b is not None]
  bad += [BadChunk(h, MissReason.CORRUPT, "malformed index record") for h in found.malformed]
  bad.sort(key=lambda b: b.chunk_hash)
  if delete_bad:
    out = []
    for b in bad:
      deleted = b.reason not in KEEP_REASONS and await store.delete(b.chunk_hash)
      out.append(dataclasses.replace(b, deleted=deleted))
    bad = out
  return len(found.records) + len(found.malformed), bad


async def collect_garbage(store: ChunkStore, *, dry_run: bool = False) -> list[Orphan] | int:
  """Orphaned data objects: listed (dry run) or removed by `ChunkStore.gc` (their count)."""
  if dry_run:
    return await find_orphans(store)
  return await store.gc()


# ---------------------------------------------------------------------------------------------
# Printing.


def _human_bytes(n: int | None) -> str:
  if n is None:
    return "n/a"
  for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
    if n < 1024 or unit == "TiB":
      return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
    n /= 1024
  raise AssertionError("unreachable")


def _layout_str(record: ChunkRecord) -> str:
  lay = record.layout
  return f"{lay.num_layers},{lay.chunk_size},{lay.num_kv_heads},{lay.head_dim},{lay.dtype}"


def _tokens_str(record: ChunkRecord) -> str:
  """A chunk's token count; a stored session tail's as "m/C" (its ids after the m real ones are
  `keys.TAIL_PAD_ID`, its KV rows zeros)."""
  m = sum(t != keys.TAIL_PAD_ID for t in record.token_ids)
  return str(m) if m == len(record.token_ids) else f"{m}/{len(record.token_ids)}"


def format_ls(found: Scan) -> list[str]:
  """One line per record, after a header; malformed records last. A stored session tail's
  tokens read "m/C"."""
  lines = [f"{'chunk':<{SHORT}}  {'namespace':<{SHORT}}  {'tokens':>7}  "
           f"{'layout L,C,K,H,dtype':<22}  encodings codec/level/bytes"]
  for r in found.records:
    encs = " ".join(f"{e.codec}/{e.level}/{e.nbytes}" for e in r.encodings)
    lines.append(f"{r.chunk_hash[:SHORT]:<{SHORT}}  {r.namespace[:SHORT]:<{SHORT}}  "
                 f"{_tokens_str(r):>7}  {_layout_str(r):<22}  {encs}")
  for h in found.malformed:
    lines.append(f"{h[:SHORT]:<{SHORT}}  MALFORMED RECORD")
  return lines


def format_du(u: Usage) -> list[str]:
  lines = [f"records: {u.records}" + (f" (+{u.malformed_records} malformed)"
                                      if u.malformed_records else "")]
  for ns, n in u.chunks_per_namespace.items():
    lines.append(f"  namespace {ns[:SHORT]}: {n} chunks")
  lines.append(f"stored bytes (values): {u.stored_bytes} ({_human_bytes(u.stored_bytes)})")
  if set(u.stored_bytes_per_codec) - {"raw/0"}:  # more than raw: say how much each holds
    lines.append("  by codec/level: " + ", ".join(
        f"{k} {v} ({_human_bytes(v)})" for k, v in u.stored_bytes_per_codec.items()))
  if u.disk_bytes is not None:
    lines.append(f"on disk: {u.disk_files} files, {u.disk_bytes} bytes "
                 f"({_human_bytes(u.disk_bytes)}; allocated "
                 f"{_human_bytes(u.disk_allocated_bytes)})")
  lines.append(f"orphaned data objects: {u.orphans} ({u.orphan_bytes} bytes)")
  return lines


def _print(lines: Sequence[str], out: TextIO) -> None:
  for line in lines:
    print(line, file=out)


def _json(obj: Any, out: TextIO) -> None:
  print(json.dumps(obj, indent=1, sort_keys=True, default=str), file=out)


# ---------------------------------------------------------------------------------------------
# Entry point.


def _define_flags(fv: flags.FlagValues) -> None:
  flags.DEFINE_string("store", None,
                      "Store URL: a path, file:///path, ocdbt+file:///path or s3://bucket/prefix "
                      "(default: <cache root>/store, $KVJAX_CACHE_DIR/store or "
                      "~/.cache/kvjax/store, where the server stores by default).",
                      flag_values=fv)
  flags.DEFINE_string("namespace", "", "Only records whose namespace id starts with this hex "
                      "prefix (ls, du, verify).", flag_values=fv)
  flags.DEFINE_bool("json", False, "Machine-readable JSON on stdout.", flag_values=fv)
  flags.DEFINE_bool("delete_bad", False, "verify: remove bad chunks (records and data), except "
                    f"{'/'.join(sorted(r.value for r in KEEP_REASONS))} ones.", flag_values=fv)
  flags.DEFINE_bool("dry_run", False, "gc: list what would be removed, remove nothing.",
                    flag_values=fv)
  flags.DEFINE_float("timeout_s", 30.0, "Limit on each storage operation, seconds.",
                     flag_values=fv)
  flags.DEFINE_string("s3_endpoint", None, "S3 endpoint URL (default $AWS_ENDPOINT_URL).",
                      flag_values=fv)
  flags.DEFINE_string("s3_region", None, "S3 region (default $AWS_REGION).", flag_values=fv)


def usage(fv: flags.FlagValues | None = None) -> str:
  if fv is None:
    fv = flags.FlagValues()
    _define_flags(fv)
  return (__doc__.split("\n\n")[1] + "\n\nFlags:\n"
          + fv.get_help(include_special_flags=False) + "\n")


async def _run(command: str, fv: flags.FlagValues, out: TextIO) -> int:
  kwargs = {}
  if fv.s3_endpoint:
    kwargs["endpoint"] = fv.s3_endpoint
  if fv.s3_region:
    kwargs["region"] = fv.s3_region
  try:
    store = ChunkStore(fv.store or specs.default_root(), timeout_s=fv.timeout_s, **kwargs)
  except ValueError as e:
    raise StoreError(str(e)) from e
  try:
    await open_store(store)
    ns = fv.namespace.lower()
    if command == "ls":
      found = await scan(store, ns)
      if fv.json:
        _json([dataclasses.asdict(r) for r in found.records]
              + [{"chunk_hash": h, "malformed": True} for h in found.malformed], out)
      else:
        _print(format_ls(found), out)
      return EXIT_OK
    if command == "du":
      u = await disk_usage(store, ns)
      if fv.json:
        _json(dataclasses.asdict(u), out)
      else:
        _print(format_du(u), out)
      return EXIT_OK
    if command == "verify":
      checked, bad = await verify(store, ns, delete_bad=fv.delete_bad)
      if fv.json:
        _json({"checked": checked, "bad": [
            dict(dataclasses.asdict(b), reason=b.reason.value) for b in bad]}, out)
      else:
        for b in bad:
          tail = " (deleted)" if b.deleted else ""
          detail = f"  {_one_line(b.detail)}" if b.detail else ""
          print(f"BAD {b.chunk_hash} {b.reason.value}{tail}{detail}", file=out)
        deleted = sum(b.deleted for b in bad)
        print(f"verified {checked} chunks: {checked - len(bad)} ok, {len(bad)} bad"
              + (f", {deleted} deleted" if fv.delete_bad else ""), file=out)
      return EXIT_BAD if bad else EXIT_OK
    if command == "gc":
      result = await collect_garbage(store, dry_run=fv.dry_run)
      if isinstance(result, list):
        if fv.json:
          _json({"dry_run": True, "orphans": [
              {"object": o.object, "nbytes": o.nbytes} for o in result]}, out)
        else:
          _print([f"would remove {o.object} ({o.nbytes} bytes)" for o in result], out)
          print(f"would remove {len(result)} unreferenced data objects "
                f"({sum(o.nbytes for o in result)} bytes)", file=out)
      elif fv.json:
        _json({"dry_run": False, "removed": result}, out)
      else:
        print(f"removed {result} unreferenced data objects", file=out)
      return EXIT_OK
    raise AssertionError(command)
  finally:
    store.close()


def _silence_stdout() -> None:
  """Points stdout at /dev/null so the interpreter's final flush cannot raise again."""
  try:
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
  except (OSError, ValueError):
    pass


def main(argv: Sequence[str], *, stdout: TextIO | None = None,
         stderr: TextIO | None = None) -> int:
  """Runs one command.

  Args:
    argv: program name, command, flags (`sys.argv` form), e.g.
      `["kvjax.store", "ls", "--store", "/tmp/kv"]`.
    stdout: where results go (default `sys.stdout`).
    stderr: where errors and usage go (default `sys.stderr`).

  Returns:
    The exit status: 0 fine, 1 `verify` found bad chunks, 2 error.
  """
  out = stdout if stdout is not None else sys.stdout
  err = stderr if stderr is not None else sys.stderr
  prog = "python -m kvjax.store"
  fv = flags.FlagValues()
  _define_flags(fv)
  if any(a in ("-h", "--help", "-help", "--helpfull") for a in argv[1:]):
    print(usage(fv), file=out, end="")
    return EXIT_OK
  try:
    rest = fv(list(argv))
  except flags.Error as e:
    print(f"{prog}: {e}", file=err)
    return EXIT_ERROR
  commands = rest[1:]
  if len(commands) != 1 or commands[0] not in COMMANDS:
    got = " ".join(commands) or "none"
    print(f"{prog}: want one command of {', '.join(COMMANDS)}; got {got} (--help for usage)",
          file=err)
    return EXIT_ERROR
  try:
    return asyncio.run(_run(commands[0], fv, out))
  except BrokenPipeError:  # `... | head`: the reader left; not an error of ours
    _silence_stdout()
    return EXIT_OK
  except StoreError as e:
    print(f"{prog} {commands[0]}: {e}", file=err)
  except Exception as e:  # noqa: BLE001  (an operator tool: one line, no traceback)
    print(f"{prog} {commands[0]}: {type(e).__name__}: {_one_line(e)}", file=err)
  return EXIT_ERROR
