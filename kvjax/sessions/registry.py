"""`SessionRegistry`: the one owner of every open chat session (leases, LRU and TTL, caps, KV
pins, tails, files); see `kvjax/sessions/__init__.py`.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import threading
import time
from typing import Any, Callable, Sequence

from kvjax.sessions.persistence import SessionFiles
from kvjax.sessions.prompt import chat_prompt, record_turn
from kvjax.sessions.truncation import TRUNCATE_NONE, rerotation_salt, truncate_prompt
from kvjax.sessions.types import (EXTENDED, ChatPrompt, PinnedSession, SessionBusy, SessionConfig,
                                  SessionInfo, SessionStats, SessionTurn, Turn, check_session_id)

_log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Session:
  turn: Turn | None = None
  turns: int = 0
  last_used_s: float = 0.0
  lease: int | None = None   # the turn in flight, or None (idle)
  fresh: bool = False        # created by the lease in flight (released: the session goes)

  @property
  def num_tokens(self) -> int:
    return len(self.turn.token_ids) if self.turn is not None else 0


_COUNTERS = ("turns", "first", "extended", "not_extended", "abandoned", "expired", "evicted",
             "closed", "conflicts", "truncated", "dropped_turns", "rerotated", "rerotated_tokens")


class SessionRegistry:
  """Every open chat session of one model (see the module docstring); thread-safe.

  A turn: `begin` (leases the session, creating it if new; `SessionBusy` if leased), `prompt`
  (the extension rule), then `finish` (records the turn) or `release` (aborted or failed: the
  session stays as it was).

  Args:
    tokenizer: the model's tokenizer (as for `chat_prompt`); None: `prompt` raises ValueError.
    config: limits (TTL, sessions, tokens).
    clock: seconds, monotonic (tests pass a fake).
  """

  def __init__(self, tokenizer: Any, config: SessionConfig | None = None, *,
               clock: Callable[[], float] = time.monotonic):
    self._tokenizer = tokenizer
    self.config = config or SessionConfig()
    self._clock = clock
    self._lock = threading.Lock()
    # In order of last use, least recent first (expiry and eviction walk from the front).
    self._sessions: collections.OrderedDict[tuple[str | None, str], _Session] = (
        collections.OrderedDict())
    self._leases = itertools.count(1)
    self._tokens = 0
    self._counts = dict.fromkeys(_COUNTERS, 0)
    self._orphans: set = set()  # leases of turns whose session was dropped while they ran
    self._pin_sink: Callable[[tuple[PinnedSession, ...]], None] | None = None
    self._pin_chunk = (1, 0)  # (tokens, bytes) of one stored chunk
    self._pinned: tuple[PinnedSession, ...] = ()
    self._files: SessionFiles | None = None
    self._tail_sink: Callable[[str | None, tuple[int, ...]], None] | None = None

  def set_tail_sink(self, sink: Callable[[str | None, tuple[int, ...]], None] | None) -> None:
    """Hands `(kv_salt, token_ids)` of every finished turn no session will extend any more to
    `sink` (e.g. `KVStoreClient.drop_tail`, which deletes the turn's stored tail): a turn the
    session's next turn replaced, and the last turn of a session closed, expired or evicted.
    Called under the registry's lock: the sink must not call back into the registry."""
    with self._lock:
      self._tail_sink = sink

  def _superseded(self, key, turn: Turn | None) -> None:
    """Hands `turn` to the tail sink unless another open session's last turn is the very same
    (salt and token ids): their stored tail is one, and that session's next turn still loads it
    (a session only in the persistence folder, not read since a restart, is not seen)."""
    if turn is None or self._tail_sink is None:
      return
    salt = turn.kv_salt if turn.kv_salt is not None else key[0]
    for other_key, other in self._sessions.items():
      t = other.turn
      if other_key != key and t is not None and t.token_ids == turn.token_ids and (
          (t.kv_salt if t.kv_salt is not None else other_key[0]) == salt):
        return
    self._tail_sink(salt, turn.token_ids)

  def set_persistence(self, directory: str | None, *, scope: str) -> None:
    """Keeps each open session's last turn in a file under `directory` too (see the module
    docstring), so a registry built later over the same folder continues it; None: memory only.
    Prunes the folder's expired files and the oldest beyond `max_sessions` now.

    Args:
      directory: the folder, e.g. `<store>/sessions/<fingerprint>` (created, mode 0700).
      scope: what the files' token ids are valid for (the model fingerprint).

    Raises:
      OSError: the folder cannot be created or listed.
    """
    files = SessionFiles(directory, scope) if directory is not None else None
    if files is not None:
      files.prune(self.config.ttl_s, self.config.max_sessions)
    with self._lock:
      self._files = files

  @property
  def persistence_dir(self) -> str | None:
    """The folder of the session files, or None (sessions in memory only)."""
    return self._files.directory if self._files is not None else None

  # ----------------------------------------------------------------------------- turns
  def begin(self, session_id: str, cache_salt: str | None = None) -> SessionTurn:
    """Leases the session for one turn, creating it if it is new (or expired).

    Raises:
      ValueError: a bad session id, or a salt that is not a string.
      SessionBusy: a turn of this session is in flight.
    """
    key = self._key(session_id, cache_salt)
    with self._lock:
      now = self._clock()
      self._expire(now)
      s = self._restore(key, now)
      if s is not None and s.lease is not None:
        self._counts["conflicts"] += 1
        raise SessionBusy(session_id, cache_salt)
      if s is None:
        s = self._sessions[key] = _Session(fresh=True)
      else:
        s.fresh = False
      s.lease, s.last_used_s = next(self._leases), now
      self._sessions.move_to_end(key)
      self._enforce_caps()
      self._publish_pins()  # its use makes it the most recent
      return SessionTurn(session_id, cache_salt, s.turns + 1, s.turn, s.lease)

  def prompt(self, turn: SessionTurn, messages: Sequence[dict[str, str]], *,
             limit: int | None = None, cut: bool = False) -> ChatPrompt:
    """The turn's prompt by the extension rule (`chat_prompt` against `turn.last`); counts
    the outcome; then its truncation to `limit` tokens, if it passes it.

    Args:
      turn: the lease.
      messages: the whole conversation, as the client sends it.
      limit: prompt tokens allowed (the context minus `max_tokens`, or the request's
        `truncate_prompt_tokens`); None: no limit.
      cut: the request asked for truncation (`truncate_prompt_tokens`): with policy "none", a
        plain left cut, and with "drop_oldest_turns" one where dropping whole turns cannot
        fit. Without it, a prompt over `limit` that dropping whole turns cannot fit (or any,
        with policy "none") is returned as is (the caller's context check refuses it).

    Returns:
      The `ChatPrompt`: `kv_salt` is the session's salt, or, for an extension of a re-rotated
      turn that needs no new truncation, that turn's private namespace; `truncation` is set
      when the ids were cut (a truncated prompt runs under the session's salt unless the caller
      stages re-rotated KV, `rerotation_salt`).

    Raises:
      ValueError, jinja2.TemplateError: as `chat_prompt` (release the turn then).
    """
    prompt = chat_prompt(self._tokenizer, messages, turn.last)
    with self._lock:
      self._counts[prompt.outcome] += 1
    salt = turn.cache_salt
    if prompt.outcome == EXTENDED and turn.last is not None:
      salt = turn.last.kv_salt if turn.last.kv_salt is not None else turn.cache_salt
    prompt = dataclasses.replace(prompt, kv_salt=salt)
    policy = self.config.truncation
    if limit is None or limit < 1 or len(prompt.token_ids) <= limit or (
        policy == TRUNCATE_NONE and not cut):
      return prompt
    tr = truncate_prompt(self._tokenizer, prompt.token_ids, limit, policy=policy, left_cut=cut)
    if tr is None:
      return prompt
    with self._lock:
      self._counts["truncated"] += 1
      self._counts["dropped_turns"] += tr.dropped_turns
    # A cut prompt is a new sequence: its KV is exact only under the session's own salt.
    return dataclasses.replace(prompt, token_ids=tr.token_ids,
                               truncation=dataclasses.replace(tr, source_kv_salt=salt),
                               kv_salt=turn.cache_salt)

  def rerotate(self, turn: SessionTurn, prompt: ChatPrompt,
               stage: Callable[..., int] | None) -> ChatPrompt:
    """With `rerotate` on and a truncated prompt, stages the kept tokens' stored KV re-rotated
    under a private namespace (`stage`: `kvjax.engine.rerotation.stage_rerotated`, blocking)
    and returns the
    prompt running under it; else (or when nothing could be staged) the prompt unchanged."""
    tr = prompt.truncation
    if tr is None or not self.config.rerotate or stage is None:
      return prompt
    b = self.config.rerotate_boundary_chunks
    salt = rerotation_salt(turn.cache_salt, tr.source_kv_salt, tr, b)
    staged = stage(tr.source_ids, tr.source_kv_salt, tr.token_ids, tr.spans, salt,
                   boundary_chunks=b)
    if not staged:
      return prompt
    self.count_rerotated(staged)
    return dataclasses.replace(prompt, kv_salt=salt, rerotated_tokens=staged)

  def finish(self, turn: SessionTurn, prompt: ChatPrompt, output_ids: Sequence[int],
             output_text: str, *, close: bool = False) -> bool:
    """Records a finished turn (`record_turn`) as the session's last and frees the session;
    with `close`, closes the session instead.

    Returns:
      Whether the session stays open holding this turn (False: closed, or dropped at once
      because this turn alone exceeds `max_tokens`, or the session had been closed while the
      turn ran, in which case nothing is recorded).
    """
    record = record_turn(self._tokenizer, prompt, output_ids, output_text)
    key = (turn.cache_salt, turn.session_id)
    with self._lock:
      s = self._sessions.get(key)
      if s is None or s.lease != turn.lease:
        self._end_orphan(turn)
        return False
      self._counts["turns"] += 1
      s.lease, s.fresh, s.last_used_s = None, False, self._clock()
      if close:
        self._drop(key, "closed")
        self._superseded(key, record)
        return False
      self._tokens += len(record.token_ids) - s.num_tokens
      self._superseded(key, s.turn)
      s.turn, s.turns = record, s.turns + 1
      self._sessions.move_to_end(key)
      self._enforce_caps()
      self._publish_pins()
      if key in self._sessions and self._files is not None:
        try:
          self._files.write(turn.session_id, turn.cache_salt, record, s.turns)
        except OSError as e:  # the session goes on in memory
          _log.warning("writing session file of %r failed: %r", turn.session_id, e)
      return key in self._sessions

  def release(self, turn: SessionTurn) -> None:
    """Ends a turn without recording it (aborted, failed): the session keeps its last
    finished turn, and a session this turn created goes away again."""
    key = (turn.cache_salt, turn.session_id)
    with self._lock:
      s = self._sessions.get(key)
      if s is None or s.lease != turn.lease:
        self._end_orphan(turn)
        return
      self._counts["abandoned"] += 1
      s.lease = None
      if s.fresh:
        del self._sessions[key]
      self._enforce_caps()

  def count_rerotated(self, tokens: int) -> None:
    """Counts one truncated turn that runs on `tokens` re-rotated prompt tokens."""
    with self._lock:
      self._counts["rerotated"] += 1
      self._counts["rerotated_tokens"] += int(tokens)

  # ----------------------------------------------------------------------------- sessions
  def close(self, session_id: str, cache_salt: str | None = None) -> bool:
    """Closes a session (a turn in flight then finishes unrecorded).

    Returns:
      Whether the session was open (False: unknown, or expired).

    Raises:
      ValueError: a bad session id or salt.
    """
    key = self._key(session_id, cache_salt)
    with self._lock:
      now = self._clock()
      self._expire(now)
      if self._restore(key, now) is None:
        return False
      self._drop(key, "closed")
      return True

  def get(self, session_id: str, cache_salt: str | None = None) -> SessionInfo | None:
    """The open session of this key, or None (unknown or expired).

    Raises:
      ValueError: a bad session id or salt.
    """
    key = self._key(session_id, cache_salt)
    with self._lock:
      now = self._clock()
      self._expire(now)
      s = self._restore(key, now)
      return None if s is None else self._info(key, s, now)

  def sessions(self) -> tuple[SessionInfo, ...]:
    """Every open session, least recently used first (after dropping expired ones): the seam
    for pinning sessions' KV in a device pool or a tier."""
    with self._lock:
      now = self._clock()
      self._expire(now)
      return tuple(self._info(k, s, now) for k, s in self._sessions.items())

  def stats(self) -> SessionStats:
    """A snapshot of the counters (expired sessions still held count as open until an access
    drops them)."""
    with self._lock:
      return SessionStats(**self._counts, open_sessions=len(self._sessions),
                          busy_sessions=sum(s.lease is not None
                                            for s in self._sessions.values()),
                          open_tokens=self._tokens)

  def __len__(self) -> int:
    with self._lock:
      return len(self._sessions)

  # ----------------------------------------------------------------------------- pinning
  def set_pin_sink(self, sink: Callable[[tuple[PinnedSession, ...]], None] | None, *,
                   chunk_size: int, chunk_nbytes: int) -> None:
    """Hands the pinned sessions (`pinned`) to `sink` now and whenever they change (called
    under the registry's lock: the sink must not call back into the registry).

    Args:
      sink: e.g. `KVStoreClient.set_pins` (takes `(kv_salt, token_ids)` pairs); None: stop.
      chunk_size: tokens per stored chunk (only full chunks are stored, so pinned).
      chunk_nbytes: bytes of one stored chunk (for `max_pinned_bytes`).
    """
    with self._lock:
      self._pin_sink = sink
      self._pin_chunk = (int(chunk_size), int(chunk_nbytes))
      self._pinned = ()
      self._publish_pins(force=True)

  def pinned(self) -> tuple[PinnedSession, ...]:
    """The sessions whose KV is pinned now, most recently used first (see the module
    docstring)."""
    with self._lock:
      self._expire(self._clock())
      return self._pins_locked()

  def _pins_locked(self) -> tuple[PinnedSession, ...]:
    cfg = self.config
    c, nbytes = self._pin_chunk
    out, used = [], 0
    for (salt, sid), s in reversed(self._sessions.items()):
      if len(out) >= cfg.max_pinned_sessions:
        break
      if s.turn is None:
        continue
      b = len(s.turn.token_ids) // c * nbytes
      if cfg.max_pinned_bytes is not None and used + b > cfg.max_pinned_bytes:
        break  # older sessions are less recent still: they go first
      used += b
      out.append(PinnedSession(sid, s.turn.kv_salt if s.turn.kv_salt is not None else salt,
                               s.turn.token_ids))
    return tuple(out)

  def _publish_pins(self, force: bool = False) -> None:
    if self._pin_sink is None:
      return
    pins = self._pins_locked()
    if force or pins != self._pinned:
      self._pinned = pins
      self._pin_sink(tuple((p.kv_salt, p.token_ids) for p in pins))

  # ----------------------------------------------------------------------------- internals
  @staticmethod
  def _key(session_id: str, cache_salt: str | None) -> tuple[str | None, str]:
    check_session_id(session_id)
    if cache_salt is not None and not isinstance(cache_salt, str):
      raise ValueError(f"cache_salt must be a string, got {type(cache_salt).__name__}")
    return (cache_salt, session_id)

  @staticmethod
  def _info(key, s: _Session, now: float) -> SessionInfo:
    return SessionInfo(session_id=key[1], cache_salt=key[0], turns=s.turns,
                       token_ids=s.turn.token_ids if s.turn is not None else (),
                       busy=s.lease is not None, idle_s=now - s.last_used_s)

  def _restore(self, key, now: float) -> _Session | None:
    """The open session of `key`: in memory, or read back from its file (then held in memory
    as just used; a file saved longer than the TTL ago is deleted)."""
    s = self._sessions.get(key)
    if s is not None or self._files is None:
      return s
    got = self._files.read(key[1], key[0])
    if got is None:
      return None
    turn, turns, saved_at = got
    if self.config.ttl_s is not None and time.time() - saved_at > self.config.ttl_s:
      self._files.delete(key[1], key[0])
      self._counts["expired"] += 1
      return None
    s = _Session(turn=turn, turns=turns, last_used_s=now)  # read back: a use (LRU order)
    self._sessions[key] = s
    self._sessions.move_to_end(key)
    self._tokens += s.num_tokens
    self._enforce_caps()
    self._publish_pins()
    return self._sessions.get(key)

  def _drop(self, key, counter: str) -> None:
    s = self._sessions.pop(key)
    if self._files is not None:
      self._files.delete(key[1], key[0])
    if s.lease is not None:
      self._orphans.add(s.lease)  # its turn will end unrecorded: counted then
    self._tokens -= s.num_tokens
    self._counts[counter] += 1
    self._superseded(key, s.turn)
    self._publish_pins()  # a pinned session's KV is unpinned

  def _end_orphan(self, turn: SessionTurn) -> None:
    """A turn whose session was closed or dropped while it ran ends unrecorded: counted as
    abandoned, once."""
    if turn.lease in self._orphans:
      self._orphans.discard(turn.lease)
      self._counts["abandoned"] += 1

  def _expire(self, now: float) -> None:
    """Drops idle sessions unused for longer than the TTL (the front of the LRU order)."""
    ttl = self.config.ttl_s
    if ttl is None:
      return
    for key, s in list(self._sessions.items()):
      if now - s.last_used_s <= ttl:
        break  # every later session was used more recently
      if s.lease is None:
        self._drop(key, "expired")

  def _enforce_caps(self) -> None:
    """Drops least recently used idle sessions while over `max_sessions` or `max_tokens`."""
    cfg = self.config
    while len(self._sessions) > cfg.max_sessions or self._tokens > cfg.max_tokens:
      victim = next((k for k, s in self._sessions.items() if s.lease is None), None)
      if victim is None:
        return  # every session is busy: none is dropped
      self._drop(victim, "evicted")
