"""S3 publish mode of a chunk store: atomic create-if-absent when the server honours it.

The create-if-absent of an index record is a conditional PUT (`If-None-Match: *`, see
`kvjax.storage.backends.specs`). On first use the store checks that the server honours it (a second
conditional create of an existing probe key must fail); if not, it falls back to tensorstore's
HEAD-then-PUT plus read-after-write verification (`kvjax/storage/backends/chunk_store.py` says what that
guarantees).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import tensorstore as ts

from kvjax.storage.backends import specs
from kvjax.storage.format.store_layout import ABSENT_PROBE_KEY

_log = logging.getLogger(__name__)
_T = TypeVar("_T")

# Written once per store open to check that conditional PUTs are honoured.
CONDITIONAL_PROBE_KEY = ".kvjax-conditional-write-probe"


def with_conditional_write(spec: dict[str, Any], on: bool) -> dict[str, Any]:
  """A copy of `spec` whose s3 kvstore (itself or an ocdbt base) has `use_conditional_write=on`."""
  if spec.get("driver") == "ocdbt":
    return {**spec, "base": with_conditional_write(spec["base"], on)}
  return {**spec, "use_conditional_write": on} if spec.get("driver") == "s3" else spec


async def publish_mode(kvstore_spec: dict[str, Any], store_name: str,
                       honours: Callable[[dict[str, Any]], Awaitable[bool]]
                       ) -> tuple[dict[str, Any], bool]:
  """Selects atomic conditional PUTs if the server honours them, else the fallback.

  Args:
    kvstore_spec: the store's kvstore spec.
    store_name: for the warning.
    honours: `(s3 spec) -> bool` (`honours_conditional_put`).

  Returns:
    (the spec to open: conditional writes switched off if the server ignores them, whether each
    publish must be verified by reading it back); a non-S3 spec comes back unchanged, False.
  """
  s3 = specs.s3_spec(kvstore_spec)
  if s3 is None:
    return kvstore_spec, False
  if s3.get("use_conditional_write") and not await honours(s3):
    _log.warning(
        "store %r: %s does not honour conditional PUTs (If-None-Match); falling back to "
        "HEAD-then-PUT with read-after-write checks, which is not atomic under racing writers",
        store_name, s3.get("endpoint", "S3"))
    kvstore_spec = with_conditional_write(kvstore_spec, False)
    s3 = specs.s3_spec(kvstore_spec)
  return kvstore_spec, not s3.get("use_conditional_write")


async def honours_conditional_put(s3: dict[str, Any], context: ts.Context,
                                  op: Callable[[Awaitable[_T]], Awaitable[_T]]) -> bool:
  """Whether a create-if-absent of an existing key fails on this server, as it must.

  Args:
    s3: the S3 kvstore spec.
    context: the store's tensorstore context.
    op: awaits one tensorstore operation under the store's timeout.
  """
  kv = await op(ts.KvStore.open(s3, context=context))
  absent = await op(kv.read(ABSENT_PROBE_KEY))
  await op(kv.write(CONDITIONAL_PROBE_KEY, b"kvjax"))
  try:
    stamp = await op(kv.write(CONDITIONAL_PROBE_KEY, b"kvjax", if_equal=absent.stamp.generation))
  except Exception as e:  # noqa: BLE001  (e.g. 501 Not Implemented)
    _log.warning("conditional PUT on %s failed: %r", s3.get("endpoint", "S3"), e)
    return False
  return not stamp.generation
