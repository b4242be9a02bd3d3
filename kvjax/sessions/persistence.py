"""Session files: each open session's last finished turn as a small JSON file, so a restarted
server over the same store folder continues the conversation (see "Persistence" in
`kvjax/sessions/__init__.py`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time

from kvjax.sessions.types import Turn

_log = logging.getLogger(__name__)


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
