"""The KV connector: the engine's side of the KV store (`kvjax.storage.TieredStore`).

Modules by concept: `records` (plain data crossing to the engine and the scheduler), `lookup`
(keys, batched prefix lookups), `request_keys` (each open request's lookup and key chain,
by request id), `loader` (background loads, staging), `prefetch` (look-ahead hints
and host-tier prefetches), `transfer` (the host -> device link), `saver` (the saver thread),
`client` (`KVStoreClient`, which owns all their state and threads) and `device` (`DeviceSeam`:
what the connector asks of the device, entropy decode, puts and gets; device work belongs to the
runner, which hands the client its seam, e.g. `kvjax/models/device_seam.py`). No module here
imports jax.
"""

from kvjax.connector.client import KVStoreClient
from kvjax.connector.device import DeviceSeam
from kvjax.connector.records import (SAVING, LoaderStats, LookaheadRequest, PrefetchStats,
                                     PrefixLookup, SaveJob, SaverStats, StoredTail, TierSnapshot)
from kvjax.connector.transfer import LayerTransfer

__all__ = ["DeviceSeam", "KVStoreClient", "LayerTransfer", "LoaderStats", "LookaheadRequest",
           "PrefetchStats", "PrefixLookup", "SAVING", "SaveJob", "SaverStats", "StoredTail",
           "TierSnapshot"]
