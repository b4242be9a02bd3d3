"""kvjax storage: chunk keys, codec byte formats, tensorstore specs, the verified chunk store,
tiers, link emulation, eviction and the tier placement planner (numpy, tensorstore, zstandard,
pcodec and xxhash only, no JAX). See `docs/design/storage-format.md`.
"""

from kvjax.storage.backends.chunk_store import (ByteLimiter, ChunkStore, StoreStats, choose_codec,
                                                default_choose)
from kvjax.storage.format.codecs import (CorruptPayload, UnknownCodec, decode_payload,
                                         encode_payload, payload_spec)
from kvjax.storage.tiering.eviction import (POLICIES, EntryInfo, FIFOPolicy, LookaheadPolicy,
                                            LRUPolicy, PlacementPolicy, make_policy)
from kvjax.storage.format.keys import (KeyNamespace, chunk_hashes, hash_chunk,
                                       prefix_chunk_hashes_for_prompt)
from kvjax.storage.backends.link import LinkLimiter, gbps, load_trace, mbps
from kvjax.storage.tiering.placement import PlacementStats, TierHierarchy, TierSpec
from kvjax.storage.backends.specs import chunk_array_spec, kvstore_spec
from kvjax.storage.tiering.tiers import (DEFAULT_STORE_CAPACITY_BYTES, HostMemoryTier, KVStore,
                                         StoreConfig, Tier, TierConfig, TieredStore, TierUsage,
                                         build_tiers, url_kind)
from kvjax.storage.format.types import (RECORD_FORMAT_VERSION, ChunkHit, ChunkMiss, ChunkOrigin,
                                        ChunkRecord, EncodedPayload, Encoding, KVLayout, MissReason)

__all__ = [
    "DEFAULT_STORE_CAPACITY_BYTES", "RECORD_FORMAT_VERSION", "ByteLimiter", "ChunkHit",
    "ChunkMiss", "ChunkOrigin", "ChunkRecord", "ChunkStore", "CorruptPayload", "EncodedPayload",
    "Encoding",
    "EntryInfo", "FIFOPolicy", "LookaheadPolicy", "HostMemoryTier", "KVLayout", "KVStore",
    "KeyNamespace", "LRUPolicy", "LinkLimiter", "MissReason", "POLICIES", "PlacementPolicy",
    "PlacementStats", "StoreConfig", "StoreStats", "Tier", "TierConfig", "TierHierarchy",
    "TierSpec", "TierUsage", "TieredStore", "UnknownCodec", "build_tiers", "choose_codec",
    "chunk_array_spec", "chunk_hashes", "decode_payload", "default_choose", "encode_payload",
    "gbps", "hash_chunk", "kvstore_spec", "load_trace", "make_policy", "mbps", "payload_spec",
    "prefix_chunk_hashes_for_prompt", "url_kind",
]
