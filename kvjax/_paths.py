"""kvjax's cache directory (a bottom floor: standard library only, every room may import it).

Converted weights, calibrated codec transforms, compiled programs and the default local store
live under one root, so the server, the Python API and `python -m kvjax.store` agree on it.
"""

from __future__ import annotations

import os


def default_cache_root() -> str:
  """`$KVJAX_CACHE_DIR`, else `~/.cache/kvjax` (an absolute path; not created here)."""
  return os.environ.get("KVJAX_CACHE_DIR") or os.path.join(
      os.path.expanduser("~"), ".cache", "kvjax")
