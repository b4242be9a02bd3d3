"""Reading one data object of a chunk store: a whole file straight into a fresh buffer with its
checksum (plain file stores), and the miss reason of a failed read."""

from __future__ import annotations

import asyncio
import os

import numpy as np

from kvjax.storage.format import checksum as checksums
from kvjax.storage.format.types import MissReason


class BadSize(Exception):
  """A data object whose length is not what its record says (truncated or grown)."""


def read_file(path: str, nbytes: int, algo: str) -> tuple[np.ndarray, str]:
  """Reads a whole file of exactly `nbytes` bytes into a fresh buffer and checksums it.

  Runs in a worker thread (`os.preadv` and xxh3 release the GIL).

  Returns:
    (uint8[nbytes] buffer, hex digest of it).

  Raises:
    FileNotFoundError: no such file.
    BadSize: the file is not `nbytes` long.
    OSError: any other read failure.
  """
  buf = read_file_range(path, nbytes, 0)
  return buf, checksums.digest(buf, algo)


def read_file_range(path: str, nbytes: int, offset: int) -> np.ndarray:
  """Reads bytes `[offset, nbytes)` of a file of exactly `nbytes` bytes into a fresh buffer
  (one seek: a layer range of a raw object reads those layers' bytes alone).

  Runs in a worker thread (`os.preadv` releases the GIL).

  Returns:
    uint8[nbytes - offset] buffer.

  Raises:
    FileNotFoundError: no such file.
    BadSize: the file is not `nbytes` long.
    OSError: any other read failure.
  """
  fd = os.open(path, os.O_RDONLY)
  try:
    size = os.fstat(fd).st_size
    if size != nbytes:
      raise BadSize(f"{size} bytes, record says {nbytes}")
    buf = np.empty(nbytes - offset, np.uint8)
    view, got = memoryview(buf), 0
    while got < len(buf):
      n = os.preadv(fd, [view[got:]], offset + got)
      if n <= 0:
        raise BadSize(f"{offset + got} bytes read, record says {nbytes}")
      got += n
  finally:
    os.close(fd)
  return buf


def first_bad_layer(buf: np.ndarray, sums: tuple[str, ...], algo: str) -> int | None:
  """The first of `len(sums)` equal byte ranges of `buf` (consecutive layers of a raw object)
  whose checksum is not its entry of `sums`, or None when all match.

  Raises:
    ValueError: `buf` does not split into `len(sums)` equal ranges.
  """
  n = len(sums)
  if not n or len(buf) % n:
    raise ValueError(f"{len(buf)} bytes do not split into {n} layers")
  step, view = len(buf) // n, memoryview(buf)
  for i, want in enumerate(sums):
    if checksums.digest(view[i * step:(i + 1) * step], algo) != want:
      return i
  return None


def status_code(e: BaseException) -> str:
  """The absl status code tensorstore puts at the front of its error messages, if any."""
  head = str(e).split(":", 1)[0].strip()
  return head if head.isupper() else ""


def data_error_reason(e: BaseException) -> MissReason:
  """Miss reason of an exception raised while opening or reading a data object."""
  if isinstance(e, (asyncio.TimeoutError, TimeoutError)):
    return MissReason.READ_ERROR
  if isinstance(e, FileNotFoundError):
    return MissReason.MISSING_DATA
  if isinstance(e, BadSize):
    return MissReason.CORRUPT
  if isinstance(e, OSError):
    return MissReason.READ_ERROR
  status = status_code(e)
  if status == "NOT_FOUND":
    return MissReason.MISSING_DATA
  if status in ("DATA_LOSS", "INVALID_ARGUMENT", "FAILED_PRECONDITION", "OUT_OF_RANGE"):
    return MissReason.CORRUPT
  return MissReason.READ_ERROR
