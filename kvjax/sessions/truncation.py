"""Truncation of a session prompt over its limit (CachedAttention, arXiv 2403.19708, section
3.4: drop whole oldest turns, keep the system prompt and the last turn) and the private
namespace of re-rotated KV (`REROTATED_SALT_PREFIX`, `rerotation_salt`);
`docs/design/truncation.md`.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Sequence


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


def is_rerotated_salt(cache_salt: Any) -> bool:
  """Whether `cache_salt` names a re-rotated namespace (`rerotation_salt`'s): the one test of
  the reserved prefix."""
  return isinstance(cache_salt, str) and cache_salt.startswith(REROTATED_SALT_PREFIX)


def check_client_salt(cache_salt: Any) -> None:
  """Raises ValueError for a client `cache_salt` in the reserved re-rotated namespace (both
  front ends: `LLM`, and the server's `kvjax.serve.protocol.check_cache_salt`)."""
  if is_rerotated_salt(cache_salt):
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
