"""The sessions room's plain records and limits: session ids, `SessionConfig`, a finished turn
(`Turn`), a turn's prompt (`ChatPrompt`), a lease (`SessionTurn`) and the registry's snapshots
(`SessionInfo`, `PinnedSession`, `SessionStats`). See `kvjax/sessions/__init__.py` for the
whole flow (CachedAttention, arXiv 2403.19708, section 3).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from kvjax.sessions.truncation import Truncation  # noqa: F401 - ChatPrompt.truncation

#: Characters a session id may hold (1 to 128 of them).
SESSION_ID_RE = re.compile(r"[A-Za-z0-9._:-]{1,128}")
DEFAULT_SESSION_TTL_S = 600.0
DEFAULT_MAX_SESSIONS = 1024
#: Token ids held over all sessions (8 Mi; as tuples of Python ints, 8 bytes of pointer plus up
#: to 28 of int object per id: at most about 300 MB of host memory at the cap).
DEFAULT_MAX_SESSION_TOKENS = 8 * 2**20
#: Sessions whose KV is pinned in the host tier at most.
DEFAULT_MAX_PINNED_SESSIONS = 64
#: Leading store chunks of a truncated prompt computed rather than re-rotated
#: (`SessionConfig.rerotate_boundary_chunks`; `scripts/bench_truncation.py`).
DEFAULT_REROTATE_BOUNDARY_CHUNKS = 1

#: `ChatPrompt.outcome` values.
FIRST = "first"                # the session had no finished turn: the normal templated prompt
EXTENDED = "extended"          # the prompt starts with the session's exact ids (a hit)
NOT_EXTENDED = "not_extended"  # the messages do not extend the last turn: templated (a miss)

#: (role, content) of one message.
Message = tuple[str, str]


def check_session_id(session_id: Any) -> str:
  """Returns `session_id` if it is a valid session id.

  Raises:
    ValueError: not a string of 1 to 128 characters from [A-Za-z0-9._:-], or "." or ".."
      (URL clients normalize those path segments away, so `DELETE /v1/sessions/{id}` could not
      name them).
  """
  if not isinstance(session_id, str) or not SESSION_ID_RE.fullmatch(session_id) or (
      session_id in (".", "..")):
    shown = repr(session_id)[:40] if isinstance(session_id, str) else type(session_id).__name__
    raise ValueError(f"session_id must be 1 to 128 characters from [A-Za-z0-9._:-], other than "
                     f"'.' and '..', got {shown}")
  return session_id


@dataclasses.dataclass(frozen=True)
class SessionConfig:
  """Limits of a `SessionRegistry`.

  Attributes:
    ttl_s: seconds a session may stay idle before it expires (dropped on the next access);
      None: never.
    max_sessions: sessions held at once; beyond, the least recently used idle one is dropped.
    max_tokens: token ids held over all sessions (each session: its last turn's prompt and
      output ids); beyond, least recently used idle sessions are dropped.
    truncation: what a turn whose prompt passes its limit (the context minus `max_tokens`, or
      `truncate_prompt_tokens`) does: "none" (an error, or a plain left cut when
      `truncate_prompt_tokens` asks for one) or "drop_oldest_turns" (CachedAttention section
      3.4: keep the system prompt and the last turn, drop whole oldest turns;
      `truncate_prompt`; when that cannot fit, an error, or a left cut when
      `truncate_prompt_tokens` asks for one).
    rerotate: with "drop_oldest_turns" and a store, re-rotate the kept turns' stored KV to
      their new positions instead of recomputing them (approximate; private namespace).
    rerotate_boundary_chunks: with `rerotate`, the truncated prompt's first store chunks that
      are computed instead of re-rotated (the system prompt and the seam right after the
      dropped turns, where the re-rotated KV deviates most;
      `kvjax.engine.rerotation.stage_rerotated`).
    max_pinned_sessions: open sessions whose stored chunks are pinned in the host tier at most
      (0: none pinned); the most recently used are pinned.
    max_pinned_bytes: bytes of pinned sessions' full chunks at most (None: only the host tier's
      room bounds them).

  Raises:
    ValueError: a limit that is not positive or an unknown policy (names the option).
  """

  ttl_s: float | None = DEFAULT_SESSION_TTL_S
  max_sessions: int = DEFAULT_MAX_SESSIONS
  max_tokens: int = DEFAULT_MAX_SESSION_TOKENS
  truncation: str = "none"
  rerotate: bool = False
  rerotate_boundary_chunks: int = DEFAULT_REROTATE_BOUNDARY_CHUNKS
  max_pinned_sessions: int = DEFAULT_MAX_PINNED_SESSIONS
  max_pinned_bytes: int | None = None

  def __post_init__(self):
    v = self.max_pinned_sessions
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
      raise ValueError(f"max_pinned_sessions={v!r} must be an int >= 0")
    v = self.max_pinned_bytes
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
      raise ValueError(f"max_pinned_session_bytes={v!r} must be None or a positive int")
    if self.ttl_s is not None and (isinstance(self.ttl_s, bool) or not isinstance(
        self.ttl_s, (int, float)) or not self.ttl_s > 0):
      raise ValueError(f"session_ttl_s={self.ttl_s!r} must be a positive number of seconds "
                       "(None, or -1 on the server's command line: sessions never expire)")
    for name, option in (("max_sessions", "max_sessions"), ("max_tokens", "max_session_tokens")):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{option}={v!r} must be a positive int")
    if self.truncation not in ("none", "drop_oldest_turns"):
      raise ValueError(f"session_truncation={self.truncation!r}; use 'none' or "
                       "'drop_oldest_turns'")
    if not isinstance(self.rerotate, bool):
      raise ValueError(f"session_rerotate={self.rerotate!r} must be a bool")
    if self.rerotate and self.truncation != "drop_oldest_turns":
      raise ValueError("session_rerotate=True needs session_truncation='drop_oldest_turns'")
    v = self.rerotate_boundary_chunks
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
      raise ValueError(f"session_rerotate_boundary_chunks={v!r} must be an int >= 0")


@dataclasses.dataclass(frozen=True)
class Turn:
  """A session's last finished turn, plain data.

  Attributes:
    messages: the turn's conversation, (role, content) per message.
    prompt_text: the turn's prompt as the chat template rendered it (generation prompt
      included).
    token_ids: the exact ids the model saw and made: the prompt ids, then the output ids.
    num_prompt_tokens: how many of `token_ids` are the prompt.
    output_text: the reply as returned to the client.
    ends_with_eos: the output's last id is the tokenizer's EOS (it stands for the template's
      end-of-turn text).
    exact: the output ids (without a final EOS) decode to exactly `output_text`; False when a
      stop string cut the text short or special tokens inside the reply were skipped. Only an
      exact turn can be extended.
    kv_salt: the cache salt the turn's KV lives under: the session's own salt, or a private
      re-rotated namespace (`REROTATED_SALT_PREFIX`) once a truncation re-rotated kept KV;
      the next turn that extends this one runs under it.
  """

  messages: tuple[Message, ...]
  prompt_text: str
  token_ids: tuple[int, ...]
  num_prompt_tokens: int
  output_text: str
  ends_with_eos: bool
  exact: bool
  kv_salt: str | None = None


@dataclasses.dataclass(frozen=True)
class ChatPrompt:
  """The prompt of one chat turn.

  Attributes:
    token_ids: the prompt's ids.
    text: the conversation rendered by the chat template (generation prompt included).
    messages: the conversation, (role, content) per message.
    outcome: `FIRST`, `EXTENDED` or `NOT_EXTENDED`.
    reused_tokens: leading ids taken verbatim from the session's last turn (0 unless extended).
    reason: why the conversation does not extend the session (`NOT_EXTENDED` only), else None.
    truncation: how the prompt was cut to its limit (`token_ids` are then the cut ids), or
      None.
    kv_salt: the cache salt the request runs under (`Turn.kv_salt`).
    rerotated_tokens: prompt tokens whose KV was staged re-rotated, the chunks after the
      computed boundary (0 unless re-rotated).
  """

  token_ids: tuple[int, ...]
  text: str
  messages: tuple[Message, ...]
  outcome: str
  reused_tokens: int = 0
  reason: str | None = None
  truncation: Truncation | None = None
  kv_salt: str | None = None
  rerotated_tokens: int = 0

  @property
  def history_tokens(self) -> int:
    """Leading tokens whose KV the session's last turn left: its ids but the last sampled one
    (which has no KV), when this prompt extends it uncut; else 0. The engine looks up that
    turn's stored tail with it (`Engine.add_request(history_tokens=)`)."""
    if self.outcome != EXTENDED or self.truncation is not None or not self.reused_tokens:
      return 0
    return self.reused_tokens - 1


class SessionBusy(Exception):
  """A turn of this session is in flight (the server answers 409)."""

  def __init__(self, session_id: str, cache_salt: str | None):
    super().__init__(f"session {session_id!r} is busy: a turn of it is still running; send the "
                     "next turn after that one finished")
    self.session_id, self.cache_salt = session_id, cache_salt


@dataclasses.dataclass(frozen=True)
class SessionTurn:
  """The lease of one turn in flight (from `SessionRegistry.begin`), plain data.

  Attributes:
    session_id: the session's id.
    cache_salt: its salt (part of the key).
    number: this turn's number in the session, from 1 (finished turns so far + 1).
    last: the session's last finished turn, or None.
    lease: identifies this lease; `finish` and `release` of a lease the session no longer
      holds (it was closed meanwhile) do nothing.
  """

  session_id: str
  cache_salt: str | None
  number: int
  last: Turn | None
  lease: int


@dataclasses.dataclass(frozen=True)
class SessionInfo:
  """One open session, plain data.

  Attributes:
    session_id: its id.
    cache_salt: its salt.
    turns: finished turns recorded.
    token_ids: the last finished turn's exact ids (prompt, then output); empty before the first.
    busy: a turn is in flight.
    idle_s: seconds since its last use (registry clock).
  """

  session_id: str
  cache_salt: str | None
  turns: int
  token_ids: tuple[int, ...]
  busy: bool
  idle_s: float


@dataclasses.dataclass(frozen=True)
class PinnedSession:
  """One session whose KV is pinned, plain data.

  Attributes:
    session_id: its id.
    kv_salt: the cache salt its last turn's KV lives under (`Turn.kv_salt`, else its salt).
    token_ids: its last finished turn's exact ids (prompt, then output).
  """

  session_id: str
  kv_salt: str | None
  token_ids: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class SessionStats:
  """The registry's counters, plain data (a snapshot).

  Attributes:
    turns: turns finished and recorded (closing turns included).
    first: turns planned without a previous turn (the normal templated prompt).
    extended: turns whose prompt extended the session's exact ids (hits).
    not_extended: turns of a session with a finished turn whose messages did not extend it
      (misses: the normal templated prompt was used).
    abandoned: turns released unrecorded (aborted, failed, or refused after planning).
    expired: sessions dropped after idling longer than the TTL.
    evicted: idle sessions dropped over `max_sessions` or `max_tokens`.
    closed: sessions closed (DELETE, `close_session`, `LLM.close_session`).
    conflicts: turns refused because their session was busy.
    truncated: turns whose prompt was cut to its limit.
    dropped_turns: whole turns dropped by those cuts ("drop_oldest_turns").
    rerotated: truncated turns that ran on re-rotated kept KV (`session_rerotate`).
    rerotated_tokens: prompt tokens those turns loaded re-rotated (staged) instead of computing.
    open_sessions: sessions held now.
    busy_sessions: of those, with a turn in flight.
    open_tokens: token ids held over all sessions.
  """

  turns: int = 0
  first: int = 0
  extended: int = 0
  not_extended: int = 0
  abandoned: int = 0
  expired: int = 0
  evicted: int = 0
  closed: int = 0
  conflicts: int = 0
  truncated: int = 0
  dropped_turns: int = 0
  rerotated: int = 0
  rerotated_tokens: int = 0
  open_sessions: int = 0
  busy_sessions: int = 0
  open_tokens: int = 0
