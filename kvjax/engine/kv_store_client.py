"""Moved: the KV store client lives in `kvjax/connector/` (`kvjax.connector.KVStoreClient`).

A thin re-export for callers outside the package; kvjax, scripts and tests import
`kvjax.connector`.
"""

from kvjax.connector import (SAVING, KVStoreClient, LayerTransfer, LoaderStats, LookaheadRequest,
                             PrefetchStats, PrefixLookup, SaveJob, SaverStats, StoredTail,
                             TierSnapshot)

__all__ = ["KVStoreClient", "LayerTransfer", "LoaderStats", "LookaheadRequest", "PrefetchStats",
           "PrefixLookup", "SAVING", "SaveJob", "SaverStats", "StoredTail", "TierSnapshot"]
