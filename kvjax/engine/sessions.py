"""Chat sessions: the exact token ids of a conversation's last turn, so that the next turn's
prompt extends them instead of re-tokenizing the whole conversation (CachedAttention, arXiv
2403.19708, section 3; the extension SGLang calls `session_id`).

Why. Re-tokenizing a whole conversation need not give back the ids the model generated: BPE can
merge across the turn boundary, and a generated "\\n" "\\n" re-tokenizes as "\\n\\n". The prefix
cache (device blocks, stored chunks) is keyed by token ids, so such a drift cuts the hit short at
the first differing token. A session keeps the ids of the last finished turn (its prompt ids
followed by its output ids) and builds the next prompt as those ids plus the tokens of the new
part only, so the hit covers every earlier token.

The extension rule (`chat_prompt`). A new conversation EXTENDS the session's last turn when its
messages are that turn's messages followed by one assistant message whose content equals that
turn's output text (and more messages, usually the user's next one). Then, with the new
conversation rendered by the model's chat template as `text`:

    head   = last.prompt_text + last.output_text        text must start with head
    start  = len(head) (+ len(eos text) when the last output ended with the EOS token: those
             ids already hold the template's end-of-turn token, so it is not added twice)
    prompt = last.token_ids + encode_chat_suffix(messages, start)

The suffix is tokenized as `encode_chat` tokenizes a prompt (special tokens written by the
TEMPLATE are control tokens, message content is plain text) with no BOS. An output that stopped
on length has no end-of-turn token, so the template's one is added as tokens. Anything else
(edited history, another reply text, fewer messages, a template that renders the earlier turns
differently, a last turn whose output ids do not spell its text: a stop string, or special tokens
generated inside the reply) is NOT an extension: the prompt is the normal templated one, and that
turn is counted as a miss (`SessionStats.not_extended`).

Ownership. `SessionRegistry` owns every session (one lock; plain Python, no timer thread); the
offline `LLM` creates one and the server (`kvjax.serve`) uses that same registry, so both go
through `SessionRegistry.prompt` (hence `chat_prompt`) and there is one extension rule. Sessions
are keyed by `(cache_salt, session_id)`: a request under another salt never sees another salt's
session. Each session holds its last finished turn (`Turn`), its last-use time and a busy flag
(a turn in flight holds a lease; a second turn on a busy session is refused with `SessionBusy`).
An aborted or failed turn is released, leaving the session as it was. Expired sessions (idle
longer than the TTL) are dropped lazily, on access and admission; over `max_sessions` or
`max_tokens` the least recently used idle session is dropped first, and a busy one never is.

Persistence (`set_persistence`; the `LLM` turns it on when its store's first persistent tier is
a local directory: `<store>/sessions/<model fingerprint>/`). Each open session's last finished
turn is also a small JSON file (`SessionFiles`: the turn's messages, prompt text, exact token
ids, reply; written atomically, mode 0600, named by a digest of the model fingerprint, salt and
session id; the salt itself is kept only as a digest), so a restarted server over the same store
folder extends the conversation and its next turn loads the stored tail. A session not in memory
is read back from its file on first use; a file under another model, salt or id is ignored.
Closing, expiring (idle past the TTL, by wall clock across restarts) or evicting a session
deletes its file; at start, expired files and the oldest beyond `max_sessions` are deleted.
Without a local store (no store, memory://, s3://) sessions live in memory only.

KV pinning (CachedAttention, arXiv 2403.19708, section 3.3: the KV of a conversation that will
come back is kept in the fast tier). The registry says which sessions are pinned
(`SessionRegistry.pinned`): open sessions with a finished turn, most recently used first, at most
`max_pinned_sessions` of them and `max_pinned_bytes` of their full chunks (the least recently
used, i.e. the oldest idle, go first). Whenever that list changes (a turn finished, a session
closed, expired or dropped) it is handed to a sink (`set_pin_sink`; the `LLM` passes the store
client's `set_pins`, which keeps those sessions' chunks in the host tier against eviction), so
closing or expiring a session unpins its KV.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import itertools
import json
import logging
import os
import re
import tempfile
import threading
import time
from typing import Any, Callable, Sequence

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

_log = logging.getLogger(__name__)


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
      dropped turns, where the re-rotated KV deviates most; `Engine.stage_rerotated`).
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


def _messages(messages: Sequence[dict[str, str]]) -> tuple[Message, ...]:
  return tuple((m["role"], m["content"]) for m in messages)


def _extension(tokenizer: Any, conv: list[dict[str, str]], msgs: tuple[Message, ...],
               text: str, last: Turn) -> tuple[tuple[int, ...] | None, str | None]:
  """(the extended prompt's ids, None), or (None, why the conversation does not extend)."""
  if not last.exact:
    return None, ("the last turn's output ids do not spell its text (a stop string or a "
                  "special token inside the reply)")
  n = len(last.messages)
  if len(msgs) < n + 1:
    return None, (f"{len(msgs)} messages: extending a turn of {n} needs its {n} messages, the "
                  "assistant's reply and the new ones")
  if msgs[:n] != last.messages:
    first = next(i for i in range(n) if msgs[i] != last.messages[i])
    return None, f"messages[{first}] differs from the session's conversation"
  if msgs[n] != ("assistant", last.output_text):
    return None, (f"messages[{n}] is not the assistant's reply of the last turn (role "
                  "'assistant', content equal to that turn's output text)")
  head = last.prompt_text + last.output_text
  if not text.startswith(head):
    return None, "the chat template renders the earlier conversation differently now"
  start = len(head)
  if last.ends_with_eos:
    eos_text = tokenizer.decode([tokenizer.eos_id], skip_special_tokens=False)
    if not text.startswith(eos_text, start):
      return None, ("the last output ends with the EOS token but the chat template does not "
                    "close the reply with it")
    start += len(eos_text)
  suffix = tokenizer.encode_chat_suffix(conv, start, add_generation_prompt=True, rendered=text)
  return last.token_ids + tuple(suffix), None


def chat_prompt(tokenizer: Any, messages: Sequence[dict[str, str]],
                last: Turn | None) -> ChatPrompt:
  """The prompt of a chat turn: the session's exact ids plus the new part when `messages`
  extend `last` (see the module docstring), else the normal templated prompt.

  Args:
    tokenizer: has `apply_chat_template`, `encode_chat`, `encode_chat_suffix`, `decode` and
      `eos_id` (`kvjax.models.tokenizer.Tokenizer`, or `ByteTokenizer`).
    messages: the conversation, `[{"role": str, "content": str}, ...]`.
    last: the session's last finished turn, or None (first turn, or no session).

  Returns:
    The `ChatPrompt` (outcome `FIRST` when `last` is None).

  Raises:
    ValueError: malformed messages, or a model without a chat template.
    jinja2.TemplateError: the template rejected the messages.
  """
  if tokenizer is None:
    raise ValueError("this model has no tokenizer: chat needs one")
  conv = list(messages)
  text = tokenizer.apply_chat_template(conv, add_generation_prompt=True)  # validates
  msgs = _messages(conv)
  if last is not None:
    ids, reason = _extension(tokenizer, conv, msgs, text, last)
    if ids is not None:
      return ChatPrompt(ids, text, msgs, EXTENDED, reused_tokens=len(last.token_ids))
  else:
    reason = None
  ids = tuple(tokenizer.encode_chat(conv, add_generation_prompt=True))
  return ChatPrompt(ids, text, msgs, FIRST if last is None else NOT_EXTENDED, reason=reason)


def record_turn(tokenizer: Any, prompt: ChatPrompt, output_ids: Sequence[int],
                output_text: str) -> Turn:
  """The `Turn` a finished chat turn leaves: its prompt, its output ids and text.

  Args:
    tokenizer: as for `chat_prompt`.
    prompt: the turn's prompt.
    output_ids: the generated ids (a final EOS included, as the engine returns them).
    output_text: the reply as returned to the client (the engine's `RequestOutput.text`).
  """
  out = tuple(int(t) for t in output_ids)
  eos = tokenizer.eos_id
  ends = bool(out) and eos is not None and out[-1] == eos
  body = out[:-1] if ends else out
  exact = tokenizer.decode(list(body), skip_special_tokens=False) == output_text
  return Turn(messages=prompt.messages, prompt_text=prompt.text,
              token_ids=prompt.token_ids + out, num_prompt_tokens=len(prompt.token_ids),
              output_text=output_text, ends_with_eos=ends, exact=exact,
              kv_salt=prompt.kv_salt)


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


#: Version of a session file's JSON (`SessionFiles`).
SESSION_FILE_VERSION = 1


class SessionFiles:
  """A folder of session files: one JSON file per open session holding its last finished turn
  (see the module docstring), written atomically (a temporary file, then `os.replace`).

  Args:
    directory: the folder (created, mode 0700).
    scope: what the token ids are valid for (the model fingerprint): a file of another scope is
      never read as a session.

  Raises:
    OSError: the folder cannot be created.
  """

  def __init__(self, directory: str, scope: str):
    self.directory, self.scope = directory, str(scope)
    os.makedirs(directory, mode=0o700, exist_ok=True)

  @staticmethod
  def _salt_digest(cache_salt: str | None) -> str | None:
    return None if cache_salt is None else hashlib.sha256(cache_salt.encode()).hexdigest()

  def path(self, session_id: str, cache_salt: str | None) -> str:
    """The file of a session: a digest of (scope, salt, id), so names reveal neither."""
    h = hashlib.sha256(json.dumps([self.scope, cache_salt, session_id]).encode()).hexdigest()
    return os.path.join(self.directory, h + ".json")

  def write(self, session_id: str, cache_salt: str | None, turn: Turn, turns: int) -> None:
    """Stores a session's last turn (atomically: readers see the old file or the new one).

    Raises:
      OSError: the write failed (the caller logs it; the session stays in memory).
    """
    kv_salt = turn.kv_salt
    rec = {"version": SESSION_FILE_VERSION, "scope": self.scope, "session_id": session_id,
           "salt_sha256": self._salt_digest(cache_salt), "turns": int(turns),
           "saved_at": time.time(), "messages": [list(m) for m in turn.messages],
           "prompt_text": turn.prompt_text, "token_ids": list(turn.token_ids),
           "num_prompt_tokens": turn.num_prompt_tokens, "output_text": turn.output_text,
           "ends_with_eos": turn.ends_with_eos, "exact": turn.exact,
           # The tenant's salt is never written: "kv_salt_is_salt" says the KV lives under it.
           "kv_salt_is_salt": kv_salt is not None and kv_salt == cache_salt,
           "kv_salt": None if kv_salt == cache_salt else kv_salt}
    data = json.dumps(rec, ensure_ascii=False, separators=(",", ":")).encode()
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=self.directory)
    try:
      with os.fdopen(fd, "wb") as f:
        f.write(data)
      os.replace(tmp, self.path(session_id, cache_salt))
    except BaseException:
      try:
        os.unlink(tmp)
      except OSError:
        pass
      raise

  def read(self, session_id: str, cache_salt: str | None) -> tuple[Turn, int, float] | None:
    """(last turn, finished turns, wall-clock seconds it was saved at) of a session's file, or
    None: no file, or one that is unreadable, malformed, or of another scope, salt or id (a
    malformed file is deleted)."""
    path = self.path(session_id, cache_salt)
    try:
      with open(path, "rb") as f:
        rec = json.loads(f.read())
      if (rec.get("version") != SESSION_FILE_VERSION or rec.get("scope") != self.scope
          or rec.get("session_id") != session_id
          or rec.get("salt_sha256") != self._salt_digest(cache_salt)):
        return None
      kv_salt = cache_salt if rec["kv_salt_is_salt"] else rec["kv_salt"]
      if kv_salt is not None and not isinstance(kv_salt, str):
        raise ValueError(f"kv_salt {kv_salt!r}")
      turn = Turn(messages=tuple((str(r), str(c)) for r, c in rec["messages"]),
                  prompt_text=str(rec["prompt_text"]),
                  token_ids=tuple(int(t) for t in rec["token_ids"]),
                  num_prompt_tokens=int(rec["num_prompt_tokens"]),
                  output_text=str(rec["output_text"]), ends_with_eos=bool(rec["ends_with_eos"]),
                  exact=bool(rec["exact"]), kv_salt=kv_salt)
      return turn, int(rec["turns"]), float(rec["saved_at"])
    except FileNotFoundError:
      return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
      _log.warning("session file %s is unreadable (%r): deleted", path, e)
      self.delete_path(path)
      return None

  def delete(self, session_id: str, cache_salt: str | None) -> None:
    self.delete_path(self.path(session_id, cache_salt))

  @staticmethod
  def delete_path(path: str) -> None:
    try:
      os.unlink(path)
    except FileNotFoundError:
      pass
    except OSError as e:
      _log.warning("deleting session file %s failed: %r", path, e)

  def prune(self, ttl_s: float | None, max_files: int) -> int:
    """Deletes files idle past `ttl_s` (wall clock; None: never) and, beyond `max_files`, the
    least recently saved. Returns how many were deleted."""
    entries = []
    for name in os.listdir(self.directory):
      if not name.endswith(".json"):
        continue
      path = os.path.join(self.directory, name)
      try:
        entries.append((os.stat(path).st_mtime, path))
      except OSError:
        continue
    entries.sort(reverse=True)  # most recent first
    now, gone = time.time(), 0
    for i, (mtime, path) in enumerate(entries):
      if i >= max_files or (ttl_s is not None and now - mtime > ttl_s):
        self.delete_path(path)
        gone += 1
    return gone


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
    if turn is not None and self._tail_sink is not None:
      self._tail_sink(turn.kv_salt if turn.kv_salt is not None else key[0], turn.token_ids)

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
    under a private namespace (`stage`: `Engine.stage_rerotated`, blocking) and returns the
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


# ------------------------------------------------------------------------------- truncation
#: `SessionConfig.truncation` values.
TRUNCATE_NONE = "none"                     # a prompt over the limit is an error (as without sessions)
DROP_OLDEST_TURNS = "drop_oldest_turns"    # drop whole oldest turns, keep the system prompt
TRUNCATION_POLICIES = (TRUNCATE_NONE, DROP_OLDEST_TURNS)
#: Namespace salts of re-rotated (approximate) KV start with this; a client's `cache_salt` may
#: not (`check_client_salt`), so no ordinary request can ever reach such a namespace.
REROTATED_SALT_PREFIX = "kvjax-rerotated:"


def rerotation_salt(cache_salt: str | None, source_salt: str | None,
                    truncation: "Truncation", boundary_chunks: int = 0) -> str:
  """The private namespace salt of a truncation's re-rotated KV: a digest of the tenant's salt,
  the namespace the source KV lives under, the source ids, the kept spans and the boundary
  chunks computed instead of re-rotated, so that the same truncation of the same conversation
  finds the same chunks again, and nothing else does.
  """
  h = hashlib.sha256(repr((cache_salt, source_salt, truncation.source_ids,
                           tuple(dataclasses.astuple(sp) for sp in truncation.spans),
                           int(boundary_chunks))).encode())
  return REROTATED_SALT_PREFIX + h.hexdigest()


def check_client_salt(cache_salt: Any) -> None:
  """Raises ValueError for a client `cache_salt` in the reserved re-rotated namespace."""
  if isinstance(cache_salt, str) and cache_salt.startswith(REROTATED_SALT_PREFIX):
    raise ValueError(f"cache_salt may not start with {REROTATED_SALT_PREFIX!r} (reserved for "
                     "re-rotated session KV)")


@dataclasses.dataclass(frozen=True)
class KeptSpan:
  """A run of kept tokens: `source_ids[src_start:src_start + length]` is
  `token_ids[dst_start:dst_start + length]` of the truncated prompt. Positions, tokens."""

  src_start: int
  dst_start: int
  length: int


@dataclasses.dataclass(frozen=True)
class Truncation:
  """How a prompt over the limit was cut (CachedAttention, arXiv 2403.19708, section 3.4).

  Attributes:
    source_ids: the prompt before truncation (the session's exact ids plus the new part).
    token_ids: the truncated prompt.
    spans: the kept runs, in prompt order; together they are all of `token_ids`.
    dropped_turns: whole turns dropped (0 for a plain left cut).
    dropped_tokens: `len(source_ids) - len(token_ids)`.
    source_kv_salt: the cache salt the source ids' KV lives under (the session's salt, or the
      last turn's re-rotated namespace when the prompt extends it).
  """

  source_ids: tuple[int, ...]
  token_ids: tuple[int, ...]
  spans: tuple[KeptSpan, ...]
  dropped_turns: int
  dropped_tokens: int
  source_kv_salt: str | None = None


def message_segments(tokenizer: Any, ids: Sequence[int]) -> list[tuple[int, int, str]] | None:
  """`(start, end, role)` of each message of a templated prompt (ChatML: each message starts
  with the `<|im_start|>` control token), or None when the tokenizer has no such token or `ids`
  does not start with one."""
  try:
    start_ids = tokenizer.encode("<|im_start|>", add_special_tokens=False)
  except Exception:  # noqa: BLE001 - a tokenizer without it cannot segment
    return None
  if len(start_ids) != 1 or not ids or ids[0] != start_ids[0]:
    return None
  marks = [i for i, t in enumerate(ids) if t == start_ids[0]] + [len(ids)]
  out = []
  for a, b in zip(marks, marks[1:]):
    head = tokenizer.decode(list(ids[a + 1:min(b, a + 4)]), skip_special_tokens=False)
    role = head.split("\n", 1)[0] if "\n" in head else ""
    out.append((a, b, role))
  return out


def truncate_prompt(tokenizer: Any, ids: Sequence[int], limit: int, *,
                    policy: str = DROP_OLDEST_TURNS, left_cut: bool = True) -> Truncation | None:
  """Cuts a templated chat prompt to at most `limit` tokens.

  `DROP_OLDEST_TURNS` (CachedAttention section 3.4): the messages are found in token space (the
  `<|im_start|>` control tokens; a session's exact ids need not re-tokenize the same); the
  system message (when first) and the last turn (the last user message onwards, generation
  prompt included) are kept; whole turns (a user message and the messages up to the next user
  message) are dropped oldest first until the prompt fits. When even that does not fit, or the
  prompt cannot be segmented, or `policy` is `TRUNCATE_NONE`: a plain left cut (vLLM's
  `truncate_prompt_tokens`: keep the last `limit` tokens) if `left_cut`, else None.

  Args:
    tokenizer: as for `chat_prompt`.
    ids: the prompt, int token ids.
    limit: tokens to keep at most, >= 1.
    policy: `DROP_OLDEST_TURNS` or `TRUNCATE_NONE` (left cut only).
    left_cut: whether a plain left cut may serve when dropping whole turns cannot (the request
      asked for at most `limit` tokens); False when it would cut into the last turn, the
      system prompt or the template unasked.

  Returns:
    The `Truncation` (unchanged ids, one span, when they already fit); None when only a left
    cut would fit and `left_cut` is False.
  """
  ids = tuple(int(t) for t in ids)
  n = len(ids)
  if n <= limit:
    return Truncation(ids, ids, (KeptSpan(0, 0, n),), 0, 0)
  segs = message_segments(tokenizer, ids) if policy == DROP_OLDEST_TURNS else None
  if segs:
    head = segs[0][1] if segs[0][2] == "system" else 0
    users = [s[0] for s in segs if s[2] == "user" and s[0] >= head]
    if users:
      tail = users[-1]
      starts = [u for u in users if u < tail] + [tail]  # turn boundaries within [head, n)
      for k, keep_from in enumerate(starts):
        if keep_from > head and head + (n - keep_from) <= limit:
          spans = [KeptSpan(0, 0, head)] if head else []
          spans.append(KeptSpan(keep_from, head, n - keep_from))
          out = ids[:head] + ids[keep_from:]
          return Truncation(ids, out, tuple(spans), k, n - len(out))
  if not left_cut:
    return None
  out = ids[n - limit:]
  return Truncation(ids, out, (KeptSpan(n - limit, 0, limit),), 0, n - limit)
