"""Operator tools over a chunk store: `python -m kvjax.store {ls,du,verify,gc} --store URL`.

See `kvjax.store.cli` for the commands; the functions below take an open `ChunkStore`.
"""

from kvjax.store.cli import (BadChunk, Orphan, Scan, StoreError, Usage, collect_garbage,
                             disk_usage, find_orphans, main, open_store, scan, verify)

__all__ = [
    "BadChunk", "Orphan", "Scan", "StoreError", "Usage", "collect_garbage", "disk_usage",
    "find_orphans", "main", "open_store", "scan", "verify",
]
