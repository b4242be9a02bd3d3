"""How a stored prefix becomes resident: the merge modes (a bottom-floor module).

Cake (arXiv 2410.03065, section 4) computes a prompt's prefix from the front while it loads
stored chunks from the back; the two baselines share its machinery (`kvjax.scheduler.cake`).
The values are stated here once: the option tree checks `kv_merge_mode` against them, the
scheduler plans by them, the engine checks a request's `merge_mode`, and the sessions room asks
for `LOAD_ONLY` on a re-rotated namespace. This module imports nothing, so every room may.
"""

from __future__ import annotations

import enum


class MergeMode(enum.Enum):
  """CAKE: both sides. COMPUTE_ONLY: ordinary chunked prefill, no loads (still saves).
  LOAD_ONLY: compute waits until every stored chunk is resident or rejected, then computes
  holes and the suffix."""

  CAKE = "cake"
  COMPUTE_ONLY = "compute_only"
  LOAD_ONLY = "load_only"


#: The modes' values, as the options and requests spell them.
MERGE_MODES = tuple(m.value for m in MergeMode)


def parse_merge_mode(value: MergeMode | str, name: str = "merge_mode") -> MergeMode:
  """The `MergeMode` of `value` (a mode or its value).

  Raises:
    ValueError: naming `name` and the accepted values, for anything else.
  """
  try:
    return MergeMode(value)
  except ValueError:
    raise ValueError(f"{name}={value!r}; use one of {list(MERGE_MODES)}") from None
