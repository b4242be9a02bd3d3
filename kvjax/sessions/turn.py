"""One chat-session turn's plan, shared by both front ends (`LLM.chat(session_id=)` in
`kvjax/entrypoints/llm.py` and the server's chat endpoint in `kvjax/serve/app.py`): plain data in
(the lease, the conversation, the output limit, the context), plain data out (`TurnPlan`: the
prompt ids, the cache salt, the history whose stored tail the engine looks up, the output tokens
reserved).

The flow of a turn (CachedAttention, arXiv 2403.19708, section 3):

    SessionRegistry.begin   lease the session (SessionBusy while a turn of it runs)
    run_turn                 prompt by the extension rule, cut to its limit (section 3.4), kept
                             KV staged re-rotated when asked  -> TurnPlan
    (the front end runs the request: ids, kv_salt, `TurnPlan.request_options()`: history_tokens,
     save_tail=True, and merge_mode=load_only under re-rotated KV)
    SessionRegistry.finish   record the finished turn (or `release` on any other ending)

Output-token reservation (`prompt_limit`): with a truncation policy, the prompt may take the
context minus the turn's output limit (`max_tokens`), so the request that follows fits; a turn
without an output limit (the server's chat without `max_tokens`: it generates into whatever room
is left) reserves one token, the least any turn generates. `truncate_prompt_tokens`, when given,
caps the limit further.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

from kvjax.merge_mode import MergeMode
from kvjax.sessions.registry import SessionRegistry
from kvjax.sessions.truncation import TRUNCATE_NONE, is_rerotated_salt
from kvjax.sessions.types import ChatPrompt, SessionTurn

#: `stage(source_ids, source_salt, target_ids, spans, target_salt, *, boundary_chunks) -> int`:
#: stores a truncation's kept KV re-rotated and returns the target tokens staged
#: (`kvjax.engine.rerotation.stage_rerotated` over the store client).
StageFn = Callable[..., int]


def output_reservation(max_tokens: int | None) -> int:
  """Output tokens a session turn reserves in the context: its output limit, or 1 without one.

  Raises:
    ValueError: a limit that is not a positive int.
  """
  if max_tokens is None:
    return 1
  if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
    raise ValueError(f"max_tokens={max_tokens!r} must be None or an int >= 1")
  return max_tokens


def prompt_limit(truncation: str, max_model_len: int | None, max_tokens: int | None,
                 truncate_prompt_tokens: int | None) -> int | None:
  """Prompt tokens a session turn may keep (None: no limit), by the reservation rule above.

  Args:
    truncation: `SessionConfig.truncation`; with "none" only `truncate_prompt_tokens` limits.
    max_model_len: the context, tokens (None: unknown, only `truncate_prompt_tokens` limits).
    max_tokens: the turn's output limit, tokens (None: none given).
    truncate_prompt_tokens: the request's own cap, tokens, or None.
  """
  limit = truncate_prompt_tokens
  if truncation != TRUNCATE_NONE and max_model_len is not None:
    limit = min(limit or max_model_len, max_model_len - output_reservation(max_tokens))
  return limit


@dataclasses.dataclass(frozen=True)
class TurnPlan:
  """What the front end runs for one session turn, plain data.

  Attributes:
    prompt: the turn's `ChatPrompt` (recorded by `SessionRegistry.finish`).
    token_ids: the prompt ids to run (cut to `limit` when truncated).
    kv_salt: the cache salt the request runs under (the session's, or a private re-rotated
      namespace).
    history_tokens: leading prompt tokens a finished turn left (their stored tail is looked
      up: `Engine.add_request(history_tokens=)`).
    reserved_output_tokens: output tokens the limit left room for (`output_reservation`).
    limit: prompt tokens allowed, or None.
  """

  prompt: ChatPrompt
  token_ids: tuple[int, ...]
  kv_salt: str | None
  history_tokens: int
  reserved_output_tokens: int
  limit: int | None

  def request_options(self) -> dict:
    """`Engine.add_request` / `AsyncEngine.submit` keywords of a session turn: it stores its
    tail and finds the last turn's; under a re-rotated namespace (`is_rerotated_salt`) it runs
    `MergeMode.LOAD_ONLY`. Re-rotated KV is not what compute would give, so a Cake merge, whose
    meeting point depends on timing, would make the answer depend on it; load-only computes
    exactly the holes (the boundary chunks, `kvjax.engine.rerotation.stage_rerotated`) and the
    suffix. Otherwise the engine's own merge mode applies."""
    options = {"save_tail": True, "history_tokens": self.history_tokens}
    if is_rerotated_salt(self.kv_salt):
      options["merge_mode"] = MergeMode.LOAD_ONLY
    return options


def run_turn(registry: SessionRegistry, turn: SessionTurn,
             messages: Sequence[dict[str, str]], *, max_model_len: int | None,
             max_tokens: int | None, truncate_prompt_tokens: int | None,
             stage: StageFn | None = None) -> TurnPlan:
  """Plans one leased turn: the prompt by the extension rule (`SessionRegistry.prompt`), cut to
  `prompt_limit`, and with `SessionConfig.rerotate` its kept KV staged re-rotated
  (`SessionRegistry.rerotate`; `stage` blocks on store reads and writes: call this off an event
  loop).

  Args:
    registry: the sessions.
    turn: the lease (`SessionRegistry.begin`); the caller releases it if this raises.
    messages: the whole conversation, `[{"role", "content"}, ...]`.
    max_model_len: the context, tokens.
    max_tokens: the turn's output limit, tokens, or None.
    truncate_prompt_tokens: the request's prompt cap, tokens, or None (also asks for a plain
      left cut where dropping whole turns cannot fit).
    stage: stores re-rotated KV (`StageFn`), or None (no store: truncated turns compute).

  Raises:
    ValueError, jinja2.TemplateError: as `chat_prompt` (malformed messages, a template that
      rejects them); ValueError for a bad `max_tokens`.
  """
  reserved = output_reservation(max_tokens)
  limit = prompt_limit(registry.config.truncation, max_model_len, max_tokens,
                       truncate_prompt_tokens)
  prompt = registry.prompt(turn, messages, limit=limit, cut=truncate_prompt_tokens is not None)
  prompt = registry.rerotate(turn, prompt, stage)
  return TurnPlan(prompt=prompt, token_ids=prompt.token_ids, kv_salt=prompt.kv_salt,
                  history_tokens=prompt.history_tokens, reserved_output_tokens=reserved,
                  limit=limit)
