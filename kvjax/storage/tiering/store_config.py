"""Frozen configuration of the store's tiers: `TierConfig`, `StoreConfig`, `url_kind`."""

from __future__ import annotations

import dataclasses
import numbers
from typing import Literal

#: Byte limit of a disk tier when its config gives none (20 GiB: ~900k tokens of SmolLM2-135M
#: bf16 KV at 23,040 bytes per token).
DEFAULT_DISK_CAPACITY_BYTES = 20 * 2**30


#: Byte limit of the store `python -m kvjax.serve` writes by default (`--kv_store`, default the
#: cache folder's `store/`), unless `--kv_store_capacity_bytes` says otherwise: 4 GiB. That is
#: 364 full 256-token chunks of SmolLM2-135M in float32 (11.8 MB, 46,080 bytes per token; 93k
#: tokens of prefixes), twice that in bfloat16; a session tail costs only its own rows. Small
#: beside the disk of any machine that runs the model, and a fixed number rather than a share of
#: free space, so a restart never shrinks (and evicts) what a fuller disk left.
DEFAULT_STORE_CAPACITY_BYTES = 4 * 2**30

#: Bytes of demotions (host -> disk, disk -> remote) in flight at most, when a config gives none
#: (64 MiB: about 11 raw 256-token chunks of SmolLM2-135M in bf16).
DEFAULT_DEMOTION_BYTES_IN_FLIGHT = 64 * 2**20

TierKind = Literal["host", "disk", "remote"]
_KINDS = ("host", "disk", "remote")
#: How `TieredStore.put` places a chunk (see `StoreConfig.placement`).
PLACEMENTS = ("write_through", "write_back")
#: Eviction policies a config can name (`StoreConfig.eviction`).
EVICTIONS = ("lru", "fifo")


def url_kind(url: str) -> Literal["disk", "remote"]:
  """Classifies a store URL (forms of `specs.kvstore_spec`): local ones are "disk", s3 "remote".

  Raises:
    ValueError: an unknown scheme.
  """
  base = url[len("ocdbt+"):] if url.startswith("ocdbt+") else url
  if base.startswith("s3://"):
    return "remote"
  if base.startswith(("memory://", "file://")) or "://" not in base:
    return "disk"
  raise ValueError(f"unknown store URL scheme {base.split('://', 1)[0]!r} in {url!r}; want "
                   "memory://, file://, a path, ocdbt+file:// or s3://")


@dataclasses.dataclass(frozen=True)
class TierConfig:
  """One tier.

  Attributes:
    kind: "host" (process memory), "disk" (a local store) or "remote" (a shared store).
    url: store URL for disk and remote tiers (see `specs.kvstore_spec`); None for host.
    capacity_bytes: byte limit. Required for host; disk defaults to
      `DEFAULT_DISK_CAPACITY_BYTES`; remote defaults to unbounded (left to the bucket's own
      lifecycle rules).
    link_bytes_per_s: emulated read bandwidth, bytes/s (see `link.gbps`); None: unlimited.
    link_trace: a rate trace file (see `link.load_trace`) instead of a constant.
    name: tier name in hits and stats; default: the kind, numbered if repeated.
  """

  kind: TierKind
  url: str | None = None
  capacity_bytes: int | None = None
  link_bytes_per_s: float | None = None
  link_trace: str | None = None
  name: str | None = None

  def __post_init__(self):
    if self.kind not in _KINDS:
      raise ValueError(f"tier kind must be one of {_KINDS}, got {self.kind!r}")
    if self.kind == "host":
      if self.url is not None:
        raise ValueError(f"a host tier takes no url, got {self.url!r}")
      if self.capacity_bytes is None:
        raise ValueError("a host tier needs capacity_bytes")
      if self.link_bytes_per_s is not None or self.link_trace is not None:
        raise ValueError("a host tier's reads are not link-limited; set the link on disk or "
                         "remote tiers")
    else:
      if self.url is None:
        raise ValueError(f"a {self.kind} tier needs a url")
      url_kind(self.url)
    cap, rate = self.capacity_bytes, self.link_bytes_per_s
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, numbers.Integral)):
      raise ValueError(f"{self.kind} tier: capacity_bytes must be an int, got {cap!r}")
    if rate is not None and (isinstance(rate, bool) or not isinstance(rate, numbers.Real)):
      raise ValueError(f"link_bytes_per_s must be a number, got {rate!r}")
    if self.capacity_bytes is not None and self.capacity_bytes <= 0:
      raise ValueError(f"{self.kind} tier: capacity_bytes must be positive, got "
                       f"{self.capacity_bytes}")
    if self.link_bytes_per_s is not None and self.link_trace is not None:
      raise ValueError("give link_bytes_per_s or link_trace, not both")
    if self.link_bytes_per_s is not None and not self.link_bytes_per_s > 0:
      raise ValueError(f"link_bytes_per_s must be positive, got {self.link_bytes_per_s}")
    if self.link_trace is not None and not self.link_trace:
      raise ValueError("link_trace must be a file path")

  @property
  def effective_capacity_bytes(self) -> int | None:
    """`capacity_bytes`, or the kind's default."""
    if self.capacity_bytes is None and self.kind == "disk":
      return DEFAULT_DISK_CAPACITY_BYTES
    return self.capacity_bytes


@dataclasses.dataclass(frozen=True)
class StoreConfig:
  """Tiers from the top (nearest the accelerator) down.

  Attributes:
    tiers: at least one; a host tier, if any, comes first and alone; names are distinct.
    placement: "write_through" (default): a put writes the host tier and the first persistent
      tier (inclusive copies; a host eviction drops the host copy only). "write_back": a put
      writes the host tier only, and a chunk a tier evicts is demoted to the next tier down
      unless that tier holds it (CachedAttention, arXiv 2403.19708, section 3.3.2; see
      `TieredStore`).
    eviction: every tier's eviction policy: "lru" (chain-aware LRU, `LRUPolicy`) or "fifo"
      (insertion order, `FIFOPolicy`: the baseline).
    demotion_bytes_in_flight: write-back only: bytes of demotions being written at most (None:
      `DEFAULT_DEMOTION_BYTES_IN_FLIGHT`).
  """

  tiers: tuple[TierConfig, ...]
  placement: Literal["write_through", "write_back"] = "write_through"
  eviction: Literal["lru", "fifo"] = "lru"
  demotion_bytes_in_flight: int | None = None

  def __post_init__(self):
    if self.placement not in PLACEMENTS:
      raise ValueError(f"placement must be one of {PLACEMENTS}, got {self.placement!r}")
    if self.eviction not in EVICTIONS:
      raise ValueError(f"eviction must be one of {EVICTIONS}, got {self.eviction!r}")
    if self.demotion_bytes_in_flight is not None and (
        isinstance(self.demotion_bytes_in_flight, bool)
        or not isinstance(self.demotion_bytes_in_flight, int)
        or self.demotion_bytes_in_flight <= 0):
      raise ValueError("demotion_bytes_in_flight must be a positive int or None, got "
                       f"{self.demotion_bytes_in_flight!r}")
    tiers = tuple(self.tiers)
    object.__setattr__(self, "tiers", tiers)
    if not tiers:
      raise ValueError("a store needs at least one tier")
    kinds = [t.kind for t in tiers]
    if kinds.count("host") > 1:
      raise ValueError("at most one host tier")
    if "host" in kinds and kinds[0] != "host":
      raise ValueError(f"the host tier must be the first (top) tier, got order {kinds}")
    if kinds == ["host"]:
      raise ValueError("a store needs a disk or remote tier below the host tier")
    names = self.tier_names
    if len(set(names)) != len(names):
      raise ValueError(f"tier names must be distinct, got {names}")

  @property
  def tier_names(self) -> tuple[str, ...]:
    """Each tier's name: its `name`, or its kind, numbered when the kind repeats."""
    counts = {k: sum(t.kind == k for t in self.tiers) for k in _KINDS}
    seen: dict[str, int] = {}
    out = []
    for t in self.tiers:
      seen[t.kind] = seen.get(t.kind, 0) + 1
      out.append(t.name or (t.kind if counts[t.kind] == 1 else f"{t.kind}{seen[t.kind]}"))
    return tuple(out)

  @classmethod
  def from_url(cls, url: str, *, host_capacity_bytes: int | None = None,
               capacity_bytes: int | None = None,
               link_bytes_per_s: float | None = None,
               placement: str = "write_through") -> "StoreConfig":
    """The simple `LLM(kv_store=url)` form: one tier, "disk" for local URLs, "remote" for s3.

    Args:
      url: store URL (memory://, file://, a path, ocdbt+file://, s3://).
      host_capacity_bytes: if given, a host tier of this size goes on top.
      capacity_bytes: the store tier's byte limit (default: by kind, see `TierConfig`).
      link_bytes_per_s: emulated read bandwidth of the store tier.
      placement: see `StoreConfig.placement`.

    Raises:
      ValueError: an unknown URL scheme or bad sizes.
    """
    tiers = [TierConfig(url_kind(url), url=url, capacity_bytes=capacity_bytes,
                        link_bytes_per_s=link_bytes_per_s)]
    if host_capacity_bytes is not None:
      tiers.insert(0, TierConfig("host", capacity_bytes=host_capacity_bytes))
    return cls(tuple(tiers), placement=placement)
