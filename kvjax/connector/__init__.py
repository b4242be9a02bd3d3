"""The KV connector: the engine's side of the KV store (`kvjax.storage.TieredStore`).

Modules by part, each owning its own state, lock and thread: `loop` (`StoreLoop`: the store's
event loop), `lookup` (`KeyScheme`: keys; `PrefixLookups`: batched prefix lookups),
`request_keys` (`OpenRequests`: each open request's lookup and key chain, by request id),
`loader` (`Loader`: background loads, staging), `prefetch` (`Prefetcher`: look-ahead hints and
host-tier prefetches), `transfer` (`HostToDevice`: the host -> device link), `saver` (`Saver`:
the saver thread); `records` (plain data crossing to the engine and the scheduler), `client`
(`KVStoreClient`, the small front that builds the parts and forwards to them) and `device`
(`DeviceSeam`: what the connector asks of the device, entropy decode, puts and gets; device
work belongs to the runner, which hands the client its seam, e.g. `kvjax/models/runner/device_seam.py`).
No module here imports jax.
"""

from kvjax.connector.client import KVStoreClient
from kvjax.connector.device import DeviceSeam
from kvjax.connector.records import (SAVING, LoaderStats, LookaheadRequest, PrefetchStats,
                                     PrefixLookup, SaveJob, SaverStats, StoredTail, TierSnapshot)
from kvjax.connector.transfer import LayerTransfer

__all__ = ["DeviceSeam", "KVStoreClient", "LayerTransfer", "LoaderStats", "LookaheadRequest",
           "PrefetchStats", "PrefixLookup", "SAVING", "SaveJob", "SaverStats", "StoredTail",
           "TierSnapshot"]
