"""Trace-driven simulation of multi-turn sessions under a KV placement policy (no model).

Replays conversations (e.g. the ShareGPT trace) against `kvjax.storage.tiering.placement.TierHierarchy`
the way CachedAttention's AttentionStore serves them (arXiv 2403.19708, sections 3.3 and 4):

  * New conversations arrive as a Poisson process (`SimConfig.arrival_rate_per_s`, default 1
    per second). Turn k + 1 of a conversation arrives a think time after turn k finishes
    (`think_time_s`, default 10 s; exponential by default, `think_time_dist="fixed"` for a
    constant; which distribution the paper uses was not checked for this simulator).
  * Service: `num_slots` requests run at once (default 32), first come first served from one
    waiting queue; a request holds its slot for `prefill_s_per_token` x (history + new prompt
    tokens) + `decode_s_per_token` x reply tokens (defaults 0.1 ms and 25 ms: a busy
    accelerator server). Service time does NOT depend on cache hits, so every policy sees
    exactly the same schedule, queue and windows (`build_schedule` runs once); only placement
    differs between policies.
  * Turn k's history is every token of turns < k (prompts and replies). It is cut into chunks
    of `chunk_tokens` (default 256); only full chunks are stored. A chunk's key is
    "<conversation id>/<index>" and its parent the previous chunk's key (the chained-hash
    structure without hashing: conversations share no chunks). Each chunk is
    `chunk_tokens` x `kv_bytes_per_token` bytes (default 23,040: SmolLM2-135M in bf16, 30 layers
    x K and V x 3 KV heads x 64 dims x 2 bytes).
  * When a request is scheduled its history chunks are looked up (`TierHierarchy.access`);
    when it finishes, every full chunk of the history plus this turn (prompt and reply) that
    no tier holds is saved (`save`), and the ones held are refreshed.
  * After every instant at which the waiting queue changed, the planner gets the window: the
    history keys of the first `window` requests waiting, in queue order (`lookahead`). The
    queue holds only requests that have arrived: no oracle beyond it.

Hit rates (`SimResult`): of the history tokens in full chunks, the tokens of the chunks found
in a tier counting from the first chunk up to the first miss (`token_hit_rate`: what a prefix
cache can use), and of all chunks found (`token_hit_rate_any`: kvjax's Cake merge also loads
chunks after a missing one); per tier; and the fraction of turns with history whose every
history chunk was found (`turn_hit_rate`).
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import itertools
import json
import random
from collections.abc import Callable, Sequence

from kvjax.storage.tiering.eviction import PlacementPolicy, make_policy
from kvjax.storage.tiering.placement import TierHierarchy, TierSpec

__all__ = ["Conversation", "Request", "Schedule", "SimConfig", "SimResult", "Turn",
           "build_schedule", "footprint_bytes", "load_sharegpt", "simulate",
           "smollm2_token_counter"]

#: SmolLM2-135M KV bytes per token in bf16: 30 layers x (K, V) x 3 KV heads x 64 dims x 2 bytes.
SMOLLM2_BF16_KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 2


@dataclasses.dataclass(frozen=True)
class Turn:
  """One round: the user's prompt and the model's reply, in tokens (chat template included)."""

  prompt_tokens: int
  reply_tokens: int


@dataclasses.dataclass(frozen=True)
class Conversation:
  """A session: its id and its rounds in order."""

  conv_id: str
  turns: tuple[Turn, ...]

  @property
  def total_tokens(self) -> int:
    """Tokens of every prompt and reply: the session's final KV length."""
    return sum(t.prompt_tokens + t.reply_tokens for t in self.turns)


@dataclasses.dataclass(frozen=True)
class SimConfig:
  """Workload, service model and chunking of a simulation.

  Attributes:
    chunk_tokens: C, tokens per stored chunk.
    kv_bytes_per_token: KV bytes of one token (all layers, K and V).
    arrival_rate_per_s: new conversations per second (Poisson).
    think_time_s: mean seconds between a reply and the next user turn.
    think_time_dist: "exponential" (mean `think_time_s`) or "fixed".
    num_slots: requests served at once.
    prefill_s_per_token: seconds per prompt token (history + new prompt) of a request.
    decode_s_per_token: seconds per reply token.
    window: requests at the head of the waiting queue whose chunks the planner sees.
    prefetch_bytes_per_s: link rate for prefetching into each upper tier, bytes per second
      (the budget of one planning call is this times the seconds since the previous call);
      None: unlimited.
    seed: seeds the arrival and think-time draws.
  """

  chunk_tokens: int = 256
  kv_bytes_per_token: int = SMOLLM2_BF16_KV_BYTES_PER_TOKEN
  arrival_rate_per_s: float = 1.0
  think_time_s: float = 10.0
  think_time_dist: str = "exponential"
  num_slots: int = 32
  prefill_s_per_token: float = 1e-4
  decode_s_per_token: float = 0.025
  window: int = 16
  prefetch_bytes_per_s: float | None = None
  seed: int = 0

  def __post_init__(self):
    if self.think_time_dist not in ("exponential", "fixed"):
      raise ValueError(f"think_time_dist must be 'exponential' or 'fixed', "
                       f"got {self.think_time_dist!r}")
    for name in ("chunk_tokens", "kv_bytes_per_token", "num_slots"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ValueError(f"{name} must be a positive int, got {v!r}")
    if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 0:
      raise ValueError(f"window must be an int >= 0, got {self.window!r}")
    for name in ("arrival_rate_per_s",):
      if not getattr(self, name) > 0:
        raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
    for name in ("think_time_s", "prefill_s_per_token", "decode_s_per_token"):
      if not getattr(self, name) >= 0:
        raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
    if self.prefetch_bytes_per_s is not None and not self.prefetch_bytes_per_s >= 0:
      raise ValueError(f"prefetch_bytes_per_s must be >= 0 or None, "
                       f"got {self.prefetch_bytes_per_s!r}")

  @property
  def chunk_bytes(self) -> int:
    """Bytes of one stored chunk."""
    return self.chunk_tokens * self.kv_bytes_per_token


@dataclasses.dataclass(frozen=True)
class Request:
  """One turn as scheduled (times in seconds from the start).

  Attributes:
    conv: index of its conversation.
    turn: index of the turn in the conversation.
    history_tokens: tokens of all earlier turns.
    prompt_tokens: the new prompt's tokens.
    reply_tokens: the reply's tokens.
    arrival_s: when it joined the waiting queue.
    dispatch_s: when it got a slot (its chunks are read).
    finish_s: when it finished (its chunks are saved).
  """

  conv: int
  turn: int
  history_tokens: int
  prompt_tokens: int
  reply_tokens: int
  arrival_s: float
  dispatch_s: float
  finish_s: float


@dataclasses.dataclass(frozen=True)
class Schedule:
  """The policy-independent timeline: requests and the ordered events that replay it.

  Attributes:
    requests: every turn, numbered in order of arrival.
    events: (time_s, kind, request index) in processing order; kind is "arrive", "dispatch"
      or "finish".
    duration_s: time of the last event.
    mean_wait_s: mean seconds a request waited in the queue.
    p90_wait_s: 90th percentile of the waits.
    waited_fraction: fraction of requests that waited at all.
    mean_queue_len: time-averaged number of waiting requests.
    max_queue_len: most requests waiting at once.
    utilization: busy slot-seconds / (slots x duration).
    mean_active_conversations: time-averaged number of conversations in progress (from their
      first arrival to their last turn's finish).
    mean_live_kv_tokens: time-averaged tokens of finished turns of conversations in progress
      (the KV a cache must keep to serve every next turn: the live working set).
  """

  requests: tuple[Request, ...]
  events: tuple[tuple[float, str, int], ...]
  duration_s: float
  mean_wait_s: float
  p90_wait_s: float
  waited_fraction: float
  mean_queue_len: float
  max_queue_len: int
  utilization: float
  mean_active_conversations: float
  mean_live_kv_tokens: float

  def summary(self) -> dict:
    """The queueing figures as plain data (no request list)."""
    return {k: getattr(self, k) for k in (
        "duration_s", "mean_wait_s", "p90_wait_s", "waited_fraction", "mean_queue_len",
        "max_queue_len", "utilization", "mean_active_conversations",
        "mean_live_kv_tokens")} | {"requests": len(self.requests)}


def _service_s(cfg: SimConfig, history: int, turn: Turn) -> float:
  return (cfg.prefill_s_per_token * (history + turn.prompt_tokens)
          + cfg.decode_s_per_token * turn.reply_tokens)


def build_schedule(conversations: Sequence[Conversation], cfg: SimConfig,
                   arrivals_s: Sequence[float] | None = None) -> Schedule:
  """Runs the queueing model once (it does not depend on the placement policy).

  Args:
    conversations: the sessions; each needs at least one turn.
    cfg: arrivals, think times and service model.
    arrivals_s: each conversation's first-turn arrival time, seconds; None: Poisson with rate
      `cfg.arrival_rate_per_s` (gaps drawn in conversation order from seed "<seed>/arrivals").

  Returns:
    The schedule. Think times are drawn per (conversation, turn) up front from seed
    "<seed>/think", so they do not depend on event order. Ties in time resolve in the order the
    events were created; a request dispatched at its arrival time is dispatched right after it.

  Raises:
    ValueError: a conversation without turns, or `arrivals_s` of another length.
  """
  if arrivals_s is None:
    rng = random.Random(f"{cfg.seed}/arrivals")
    t, arrivals_s = 0.0, []
    for _ in conversations:
      t += rng.expovariate(cfg.arrival_rate_per_s)
      arrivals_s.append(t)
  arrivals_s = list(arrivals_s)
  if len(arrivals_s) != len(conversations):
    raise ValueError(f"{len(arrivals_s)} arrival times for {len(conversations)} conversations")
  rng = random.Random(f"{cfg.seed}/think")
  think: list[list[float]] = []
  for c in conversations:
    if not c.turns:
      raise ValueError(f"conversation {c.conv_id!r} has no turns")
    think.append([cfg.think_time_s if cfg.think_time_dist == "fixed" or cfg.think_time_s == 0
                  else rng.expovariate(1.0 / cfg.think_time_s) for _ in c.turns[1:]])

  seq = 0
  heap: list[tuple[float, int, str, int, int]] = []  # (time, seq, kind, conv, turn)

  def push(t: float, kind: str, conv: int, turn: int) -> None:
    nonlocal seq
    heapq.heappush(heap, (t, seq, kind, conv, turn))
    seq += 1

  for i, t in enumerate(arrivals_s):
    push(t, "arrive", i, 0)
  history = [0] * len(conversations)
  req_of: dict[tuple[int, int], int] = {}
  fields: list[dict] = []
  events: list[tuple[float, str, int]] = []
  queue: collections.deque[int] = collections.deque()
  free = cfg.num_slots
  busy_s = 0.0
  queue_area, last_t, max_q = 0.0, 0.0, 0
  active, live = 0, 0  # conversations in progress, their finished turns' tokens
  active_area, live_area = 0.0, 0.0
  while heap:
    t, _, kind, c, k = heapq.heappop(heap)
    queue_area += len(queue) * (t - last_t)
    active_area += active * (t - last_t)
    live_area += live * (t - last_t)
    last_t = t
    if kind == "finish":
      free += 1
      r = req_of[(c, k)]
      events.append((t, "finish", r))
      turn = conversations[c].turns[k]
      history[c] += turn.prompt_tokens + turn.reply_tokens
      if k + 1 < len(conversations[c].turns):
        live += turn.prompt_tokens + turn.reply_tokens
        push(t + think[c][k], "arrive", c, k + 1)
      else:  # the conversation is over: its KV is never read again
        active -= 1
        live -= history[c] - turn.prompt_tokens - turn.reply_tokens
    else:
      active += k == 0
      r = len(fields)
      req_of[(c, k)] = r
      turn = conversations[c].turns[k]
      fields.append(dict(conv=c, turn=k, history_tokens=history[c],
                         prompt_tokens=turn.prompt_tokens, reply_tokens=turn.reply_tokens,
                         arrival_s=t))
      events.append((t, "arrive", r))
      queue.append(r)
      max_q = max(max_q, len(queue))
    while free and queue:
      r = queue.popleft()
      free -= 1
      f = fields[r]
      turn = conversations[f["conv"]].turns[f["turn"]]
      s = _service_s(cfg, f["history_tokens"], turn)
      busy_s += s
      f["dispatch_s"], f["finish_s"] = t, t + s
      events.append((t, "dispatch", r))
      push(t + s, "finish", f["conv"], f["turn"])
  requests = tuple(Request(**f) for f in fields)
  waits = sorted(r.dispatch_s - r.arrival_s for r in requests)
  duration = last_t
  return Schedule(
      requests=requests, events=tuple(events), duration_s=duration,
      mean_wait_s=sum(waits) / len(waits) if waits else 0.0,
      p90_wait_s=waits[min(len(waits) - 1, int(0.9 * len(waits)))] if waits else 0.0,
      waited_fraction=sum(w > 0 for w in waits) / len(waits) if waits else 0.0,
      mean_queue_len=queue_area / duration if duration > 0 else 0.0,
      max_queue_len=max_q,
      utilization=busy_s / (cfg.num_slots * duration) if duration > 0 else 0.0,
      mean_active_conversations=active_area / duration if duration > 0 else 0.0,
      mean_live_kv_tokens=live_area / duration if duration > 0 else 0.0)


@dataclasses.dataclass
class SimResult:
  """Outcome of one policy on one schedule (plain data; tokens unless stated).

  Attributes:
    policy: the policy's name.
    window: requests the planner saw (`SimConfig.window`).
    tiers: tier name -> capacity in bytes (None: unbounded).
    turns: requests served.
    turns_with_history: of those, requests whose history has at least one full chunk.
    turns_full_hit: of those, requests whose every full history chunk was found.
    history_tokens: history tokens of all requests (the partial last chunk included).
    chunk_tokens: history tokens in full chunks (what can be cached).
    hit_tokens: tokens of the chunks found from the first chunk up to the first miss.
    hit_tokens_any: tokens of every chunk found.
    hit_tokens_by_tier: tier name -> tokens of the chunks found there (as `hit_tokens_any`).
    placement: the planner's final `PlacementStats`, as a dict (plus "prefetches_pending").
  """

  policy: str
  window: int
  tiers: dict[str, int | None]
  turns: int = 0
  turns_with_history: int = 0
  turns_full_hit: int = 0
  history_tokens: int = 0
  chunk_tokens: int = 0
  hit_tokens: int = 0
  hit_tokens_any: int = 0
  hit_tokens_by_tier: dict[str, int] = dataclasses.field(default_factory=dict)
  placement: dict = dataclasses.field(default_factory=dict)

  @property
  def token_hit_rate(self) -> float:
    """`hit_tokens` / `chunk_tokens` (0 when there is nothing to hit)."""
    return self.hit_tokens / self.chunk_tokens if self.chunk_tokens else 0.0

  @property
  def token_hit_rate_any(self) -> float:
    """`hit_tokens_any` / `chunk_tokens`."""
    return self.hit_tokens_any / self.chunk_tokens if self.chunk_tokens else 0.0

  @property
  def turn_hit_rate(self) -> float:
    """`turns_full_hit` / `turns_with_history`."""
    return self.turns_full_hit / self.turns_with_history if self.turns_with_history else 0.0

  def count_lookup(self, found: Sequence[str | None], chunk_tokens: int) -> None:
    """Counts one request's lookup of its history's full chunks: `found[j]` is the tier that
    held chunk j, or None for a miss; hits count from the first chunk up to the first miss
    (`hit_tokens`), and every chunk found (`hit_tokens_any`, by tier)."""
    n = len(found)
    self.turns_with_history += 1
    self.chunk_tokens += n * chunk_tokens
    lead = next((j for j, t in enumerate(found) if t is None), n)
    self.hit_tokens += lead * chunk_tokens
    self.turns_full_hit += lead == n
    for t in found:
      if t is not None:
        self.hit_tokens_any += chunk_tokens
        self.hit_tokens_by_tier[t] += chunk_tokens

  def to_dict(self) -> dict:
    """Every field and rate as JSON-ready plain data."""
    d = dataclasses.asdict(self)
    d.update(token_hit_rate=self.token_hit_rate, token_hit_rate_any=self.token_hit_rate_any,
             turn_hit_rate=self.turn_hit_rate,
             tier_hit_rate={t: v / self.chunk_tokens if self.chunk_tokens else 0.0
                            for t, v in self.hit_tokens_by_tier.items()})
    return d


def simulate(conversations: Sequence[Conversation], schedule: Schedule,
             policy: str | PlacementPolicy, tiers: Sequence[TierSpec],
             cfg: SimConfig) -> SimResult:
  """Replays `schedule` with a fresh `TierHierarchy(tiers, policy)`: the planner and the policy
  class (`kvjax.storage.tiering.eviction.make_policy`) the real tiers run.

  Args:
    conversations: the sessions `schedule` was built from.
    schedule: from `build_schedule(conversations, cfg)`.
    policy: a placement policy or its registry name.
    tiers: the hierarchy, top first (e.g. host and disk).
    cfg: chunking, window and prefetch link (the service model is already in `schedule`).

  Returns:
    The hit counts and the planner's stats.

  Raises:
    ValueError: a bad tier list or policy (see `TierHierarchy`).
  """
  h = TierHierarchy(tiers, make_policy(policy) if isinstance(policy, str) else policy)
  C = cfg.chunk_tokens
  nbytes = cfg.chunk_bytes
  res = SimResult(policy=h.policy.name, window=cfg.window,
                  tiers={t.name: t.capacity_bytes for t in tiers},
                  hit_tokens_by_tier={t.name: 0 for t in tiers})
  keys = [[f"{c.conv_id}/{j}" for j in range(c.total_tokens // C)] for c in conversations]
  queue: collections.deque[int] = collections.deque()
  events = schedule.events
  last_plan_s = 0.0
  i = 0
  while i < len(events):
    now = events[i][0]
    changed = False
    while i < len(events) and events[i][0] == now:  # one planning call per instant
      _, kind, r = events[i]
      i += 1
      req = schedule.requests[r]
      ks = keys[req.conv]
      if kind == "arrive":
        queue.append(r)
        changed = True
      elif kind == "dispatch":
        if not queue or queue[0] != r:
          raise ValueError(f"schedule dispatches request {r} out of queue order")
        queue.popleft()
        changed = True
        n = req.history_tokens // C
        res.turns += 1
        res.history_tokens += req.history_tokens
        if n == 0:
          continue
        res.count_lookup(h.access(ks[:n]).tiers, C)
      else:  # finish: save what the tiers lack
        end = (req.history_tokens + req.prompt_tokens + req.reply_tokens) // C
        for j in range(end):
          h.save(ks[j], nbytes, ks[j - 1] if j else None)
    if changed:
      budgets = None
      if cfg.prefetch_bytes_per_s is not None:
        b = int(cfg.prefetch_bytes_per_s * (now - last_plan_s))
        budgets = {t.name: b for t in tiers[:-1]}
      last_plan_s = now
      window = [keys[schedule.requests[r].conv][:schedule.requests[r].history_tokens // C]
                for r in itertools.islice(queue, cfg.window)]
      h.lookahead(window, budgets)
  st = h.stats()
  res.placement = dataclasses.asdict(st) | {"prefetches_pending": st.prefetches_pending}
  return res


def footprint_bytes(conversations: Sequence[Conversation], kv_bytes_per_token: int) -> int:
  """The whole trace's KV footprint: the sum over sessions of their final KV size, bytes."""
  return sum(c.total_tokens for c in conversations) * kv_bytes_per_token


def load_sharegpt(path: str, count_tokens: Callable[[str, str], int], *,
                  system_tokens: int = 0, limit: int | None = None) -> list[Conversation]:
  """Conversations of a ShareGPT JSON file (`[{"id", "conversations": [{"from", "value"}]}]`).

  Rounds are (human, gpt) pairs in order; a trailing human message without a reply is
  dropped, and so is a conversation without a full round.

  Args:
    path: the JSON file.
    count_tokens: (role, content) -> tokens of that message as the chat template renders it
      (role "user" or "assistant").
    system_tokens: tokens the template adds before the first message (added to turn 0's prompt).
    limit: keep the first `limit` conversations (None: all).

  Raises:
    OSError: the file cannot be read.
    ValueError: not valid JSON, or a conversation that does not alternate human and gpt.
  """
  with open(path, encoding="utf-8") as f:
    data = json.load(f)
  out = []
  for item in data[:limit] if limit is not None else data:
    msgs = item["conversations"]
    turns = []
    for j in range(0, len(msgs) - 1, 2):
      u, a = msgs[j], msgs[j + 1]
      if u["from"] != "human" or a["from"] != "gpt":
        raise ValueError(f"{path}: conversation {item['id']!r} does not alternate human/gpt "
                         f"at message {j}")
      turns.append(Turn(count_tokens("user", u["value"]) + (system_tokens if not turns else 0),
                        count_tokens("assistant", a["value"])))
    if turns:
      out.append(Conversation(str(item["id"]), tuple(turns)))
  return out


def smollm2_token_counter() -> tuple[Callable[[str, str], int], int]:
  """SmolLM2's tokenizer as a message counter for `load_sharegpt`: (count_tokens,
  system_tokens).

  A message renders as `<|im_start|>{role}\\n{content}<|im_end|>\\n` (ChatML); the special
  tokens split the text, so the tokens of a whole conversation are the sum of its messages'
  plus the template's default system message, exactly. Content is tokenized as plain text
  (as `Tokenizer.encode_chat` does).

  Raises:
    FileNotFoundError: the SmolLM2 GGUF package is not installed.
  """
  from kvjax.testing import tokenizers  # noqa: PLC0415  (only the ShareGPT path needs it)

  tok = tokenizers.smollm2_tokenizer()
  end = len(tok.encode("<|im_end|>\n", add_special_tokens=False))
  heads = {role: len(tok.encode(f"<|im_start|>{role}\n", add_special_tokens=False))
           for role in ("user", "assistant")}

  def count(role: str, content: str) -> int:
    return (heads[role] + end
            + len(tok.encode(content, add_special_tokens=False, parse_special=False)))

  probe = [{"role": "user", "content": "x"}]
  system = len(tok.encode_chat(probe, add_generation_prompt=False)) - count("user", "x")
  return count, system
