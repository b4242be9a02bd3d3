"""The extension rule: a chat turn's prompt as the session's exact ids plus the new part
(`chat_prompt`), and the `Turn` a finished turn leaves (`record_turn`). The rule is stated in
`kvjax/sessions/__init__.py` (CachedAttention, arXiv 2403.19708, section 3).
"""

from __future__ import annotations

from typing import Any, Sequence

from kvjax.sessions.types import EXTENDED, FIRST, NOT_EXTENDED, ChatPrompt, Message, Turn


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
      `eos_id` (`kvjax.models.loading.tokenizer.Tokenizer`, or `ByteTokenizer`).
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
