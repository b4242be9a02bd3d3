"""Scheduler configuration: slots, token budget, chunk sizes, prefill order, how prefixes load.

Frozen records the `Scheduler` (`kvjax/scheduler/scheduler.py`) is built with; each checks its
own fields and raises ValueError on a bad one.
"""

from __future__ import annotations

import dataclasses

from kvjax.merge_mode import parse_merge_mode
from kvjax.scheduler import layer_split
from kvjax.scheduler.prefill_policy import PREFILL_ORDERS, SHORTEST_FIRST

#: `LoadConfig.layer_split` values (the `kv_layer_split` option).
LAYER_SPLITS = ("off", "auto")

@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
  """Attributes:
    num_slots: decode slots (maximum running requests).
    token_budget: tokens computed per step at most (decodes count one each).
    chunk_sizes: compiled prefill chunk sizes, ascending.
    long_prefill_token_threshold: vLLM's option of that name: a request's prefill (ordinary,
      or a Cake merge's compute side) takes at most this many tokens of one step, so a long
      prompt shares the budget with other requests' prefills; 0 (default): off. When > 0 it
      must be at least the smallest chunk size (a long prompt could not advance otherwise).
    prefill_order: the order prefills under way take the budget
      (`kvjax/scheduler/prefill_policy.py`):
      "shortest_first" (default) or "fcfs".
    short_first_token_steps: with "shortest_first", keep a step short when it carries a
      prefill's first token or a store hit's last loads (cutting the longer prefills; those
      that end within the step go whole), or let it wait for a hit's loads that land within
      half a step (`kvjax/scheduler/prefill_policy.py`): True (default).
    enable_prefix_caching: keep finished requests' full blocks on the device and share them
      with later requests of the same prefix (namespace and `cache_salt`; the scheduler's
      `KVCacheManager`): True (default).
    step_buckets: the runner's compiled step token counts, ascending (`Runner.buckets`): a
      step runs padded to the smallest that holds its tokens, and the joint Cake rules price
      it so (`kvjax/scheduler/cake_joint.py`); () (default): a step runs its tokens.

  Raises:
    ValueError: non-positive slots or budget, unsorted sizes or buckets, a budget or threshold
      below the smallest size, or an unknown `prefill_order`.
  """

  num_slots: int = 4
  token_budget: int = 512
  chunk_sizes: tuple[int, ...] = (16, 32, 64, 128, 256, 512)
  long_prefill_token_threshold: int = 0
  prefill_order: str = SHORTEST_FIRST
  short_first_token_steps: bool = True
  enable_prefix_caching: bool = True
  step_buckets: tuple[int, ...] = ()

  def __post_init__(self):
    b = self.step_buckets
    if any(isinstance(x, bool) or not isinstance(x, int) for x in b) or list(b) != sorted(
        set(b)) or (b and b[0] < 1):
      raise ValueError(f"step_buckets={b!r} must be ascending distinct ints >= 1")
    if not isinstance(self.enable_prefix_caching, bool):
      raise ValueError(f"enable_prefix_caching={self.enable_prefix_caching!r} must be a bool")
    if not isinstance(self.short_first_token_steps, bool):
      raise ValueError(f"short_first_token_steps={self.short_first_token_steps!r} must be a bool")
    if self.prefill_order not in PREFILL_ORDERS:
      raise ValueError(f"prefill_order={self.prefill_order!r}; use one of {PREFILL_ORDERS}")
    if self.num_slots <= 0 or self.token_budget <= 0:
      raise ValueError(f"num_slots={self.num_slots} and token_budget={self.token_budget} must be "
                       "positive")
    if not self.chunk_sizes or list(self.chunk_sizes) != sorted(set(self.chunk_sizes)):
      raise ValueError(f"chunk_sizes must be ascending and distinct, got {self.chunk_sizes}")
    if self.token_budget < self.chunk_sizes[0]:
      raise ValueError(f"token_budget={self.token_budget} is below the smallest chunk size "
                       f"{self.chunk_sizes[0]}: long prompts could never be scheduled")
    t = self.long_prefill_token_threshold
    if isinstance(t, bool) or not isinstance(t, int) or t < 0:
      raise ValueError(f"long_prefill_token_threshold={t!r} must be an int >= 0 (0: off)")
    if 0 < t < self.chunk_sizes[0]:
      raise ValueError(f"long_prefill_token_threshold={t} is below the smallest chunk size "
                       f"{self.chunk_sizes[0]}: long prompts could never be scheduled")


@dataclasses.dataclass(frozen=True)
class LoadConfig:
  """How stored prefixes become resident.

  Attributes:
    merge_mode: "cake" (compute from the front, load from the back), "compute_only" (ignore
      hits) or "load_only" (wait for every stored chunk): the baselines share the machinery.
    max_loads_in_flight: reads at once per request (the executor's concurrency); None derives
      it from the link's bandwidth and latency (`reads_at_once`).
    max_loads_ahead: loads issued ahead per request (queued or reading); None derives it from
      the link's bandwidth-delay product over one step (`loads_ahead`).
    link_latency_s: the store link's latency prior, seconds (a read's fixed cost), for the
      bandwidth-delay product.
    staging_bytes: stored bytes a request may have issued and not yet inserted, at most.
    kv_ttft_target_s: pick encodings for this TTFT target instead of for the time compute would
      finish each chunk (CacheGen, arXiv 2310.07240, section 5.3).
    check_writes: keep each merge's per-position writer map (raises on a double write).
    layerwise_groups: layer-wise pre-loading (CachedAttention, arXiv 2403.19708, section
      3.2.1): a step that inserts stored chunks and computes runs as this many layer groups,
      each chunk's group g inserted just before group g runs, so the host -> device transfer
      overlaps the step's compute; a request's landed chunks wait staged while its other loads
      are in flight (when the staging budget holds them), so they go in with the step that
      computes after them. 1 (default): off.
    lookahead_window: waiting requests with stored chunks whose chunks the executor hints
      (never evicted) and prefetches toward the host tier (CachedAttention, arXiv 2403.19708,
      section 3.3; `SchedulerOutput.lookahead`); 0: off (plain LRU, no prefetch).
    joint_planning: several requests restoring at once are planned together
      (`kvjax/scheduler/cake_joint.py`): shortest remaining first (aged by arrival) over the
      shared link and the budget, each merge's meeting point chosen against the backlog of the
      ones ahead of it. False: each merge plans as if alone (loads issued oldest first, the
      link split between them). One restoring request plans the same either way.
    consistent: with a lossy codec, make every output independent of which chunks were loaded
      (identical requests get identical answers): each request reads only the first stored
      level, and computed chunks pass through that same encode/decode, in steps of one store
      chunk (`Scheduler(consistent=True)`; the engine turns it off for a raw store).
    layer_split: the layer axis of Cake (CacheFlow, arXiv 2604.25080;
      `kvjax/scheduler/layer_split.py`): "auto" lets a merge split its meeting chunk along
      layers (compute layers `[0, k)`, load `[k, L)` of a raw chunk; k from the measured rates);
      "off" (default): token-only Cake. The engine turns "auto" into `layer_split_points`
      (the k its runner stops a piece at, `Runner.layer_split_points`) and `num_layers` (L).
    layer_split_points: the layer counts k in `[1, num_layers)` a merge may compute of its
      meeting chunk while loading only that chunk's layers `[k, L)` (of a layer-sliceable
      encoding: raw). () (default): off, token-only Cake.
    num_layers: L, the model's layers (needed with `layer_split_points`).
  """

  merge_mode: str = "cake"
  max_loads_in_flight: int | None = None
  max_loads_ahead: int | None = None
  link_latency_s: float = 1e-3
  staging_bytes: int = 1 << 30
  kv_ttft_target_s: float | None = None
  check_writes: bool = False
  layerwise_groups: int = 1
  lookahead_window: int = 0
  joint_planning: bool = True
  consistent: bool = False
  layer_split: str = "off"
  layer_split_points: tuple[int, ...] = ()
  num_layers: int = 0

  def __post_init__(self):
    if not isinstance(self.consistent, bool):
      raise ValueError(f"consistent={self.consistent!r} must be a bool")
    if self.layer_split not in LAYER_SPLITS:
      raise ValueError(f"layer_split={self.layer_split!r}; use one of {LAYER_SPLITS}")
    layer_split.check_points(self.layer_split_points, self.num_layers)
    if not isinstance(self.joint_planning, bool):
      raise ValueError(f"joint_planning={self.joint_planning!r} must be a bool")
    w = self.lookahead_window
    if isinstance(w, bool) or not isinstance(w, int) or w < 0:
      raise ValueError(f"lookahead_window={w!r} must be an int >= 0")
    g = self.layerwise_groups
    if isinstance(g, bool) or not isinstance(g, int) or g < 1:
      raise ValueError(f"layerwise_groups={g!r} must be an int >= 1")
    parse_merge_mode(self.merge_mode)
    for name in ("max_loads_in_flight", "max_loads_ahead"):
      v = getattr(self, name)
      if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
        raise ValueError(f"{name}={v!r} must be None or an int >= 1")
    if not self.link_latency_s >= 0 or not self.staging_bytes > 0:
      raise ValueError(f"link_latency_s={self.link_latency_s} must be >= 0 and staging_bytes="
                       f"{self.staging_bytes} > 0")
