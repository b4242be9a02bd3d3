"""Tool calls on the chat endpoint: the request's checks, the default rendering of tools, calls
and results into the chat template's plain messages, and the parser of calls in the reply.

The rendering is Hermes-style, the format Qwen2.5's and Qwen3's own chat templates write (and
what many open models are tuned on); kvjax uses it for every model, since SmolLM2's template has
no tool format of its own. Only `{role, content}` messages reach the chat template:

    tools                 a system message first (appended to the first message when that is a
                          system one): `TOOLS_HEADER`, one JSON line per tool in <tools></tools>,
                          then `TOOLS_FOOTER` (how to call)
    assistant tool_calls  its content and a newline, then per call (back to back)
                          <tool_call>\\n{"name": NAME, "arguments": ARGUMENTS}\\n</tool_call>
    tool messages         a run of them is one user message, each
                          <tool_response>\\n{content}\\n</tool_response>

The reply is parsed back (`parse_reply`): every `<tool_call>` block holding a JSON object with a
known `name` and an object `arguments` is a call; the text before the first block is the
content. A block that does not parse leaves the whole reply as content.

Exact tokens (`kvjax.sessions`: a session turn's prompt is the last turn's exact ids plus the new
part only when the history holds the reply's text verbatim). A client sends a tool-call reply back
as structured `tool_calls`, not as the text the model wrote, and the model's spacing inside the
JSON is its own; so an assistant message whose content and calls equal what `parse_reply` reads
from the session's last reply is rendered as that reply's text, verbatim
(`render_conversation(last_reply=)`): the next turn then extends the session's ids and reuses every
cached token. Any other assistant message gets the canonical rendering above (also what a forced
tool call, `tool_choice` "required" or named, generates).
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Any, Sequence

from kvjax.serve import protocol
from kvjax.serve.protocol import bad_request

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
TOOLS_HEADER = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                "You are provided with function signatures within <tools></tools> XML tags:\n"
                "<tools>")
TOOLS_FOOTER = ("</tools>\n\nFor each function call, return a json object with function name "
                "and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
                '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
#: OpenAI's rule for function names.
_NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
_BLOCK_RE = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)(?:" + re.escape(TOOL_CALL_CLOSE)
                       + r"|\Z)", re.DOTALL)


@dataclasses.dataclass(frozen=True)
class ParsedCall:
  """One tool call read from a reply: the function's name and its arguments as JSON text."""

  name: str
  arguments: str


@dataclasses.dataclass(frozen=True)
class ParsedReply:
  """A reply split into its content (None when empty) and its tool calls (possibly none)."""

  content: str | None
  calls: tuple[ParsedCall, ...]


# ------------------------------------------------------------------------------- checks
def check_request(req: protocol.ChatCompletionRequest) -> None:
  """Checks tools, `tool_choice` and the tool messages of the history.

  Raises:
    ApiError: 400 naming the field: a function name outside [A-Za-z0-9_-]{1,64} or given
      twice; `parameters` that are not a JSON Schema of an object (`jsonschema`'s meta-schema
      check when it is installed); `tool_choice` "required" or named without tools, or naming
      an unknown function; a `tool` message without `tool_call_id`, not answering a call of
      the assistant message before it; `tool_calls` on a message that is not the assistant's.
  """
  names: set[str] = set()
  for i, tool in enumerate(req.tools or ()):
    fn, where = tool.function, f"tools[{i}].function"
    if not _NAME_RE.fullmatch(fn.name):
      raise bad_request(f"Invalid '{where}.name': {fn.name!r} must be 1 to 64 characters from "
                        "[a-zA-Z0-9_-].", f"{where}.name")
    if fn.name in names:
      raise bad_request(f"Invalid '{where}.name': the function {fn.name!r} is defined twice.",
                        f"{where}.name")
    names.add(fn.name)
    if fn.parameters is not None:
      _check_schema(fn.parameters, f"{where}.parameters")
  choice = req.tool_choice
  if choice in ("required",) or isinstance(choice, protocol.NamedToolChoice):
    if not names:
      raise bad_request("tool_choice requires tools: give at least one function in 'tools'.",
                        "tool_choice")
  if isinstance(choice, protocol.NamedToolChoice) and choice.function.name not in names:
    raise bad_request(f"Invalid 'tool_choice': no function named {choice.function.name!r} in "
                      "'tools'.", "tool_choice")
  open_ids: set[str] = set()
  for i, m in enumerate(req.messages):
    if m.tool_calls is not None and m.role != "assistant":
      raise bad_request(f"messages[{i}].tool_calls: only an 'assistant' message has tool calls.",
                        f"messages[{i}].tool_calls")
    if m.tool_call_id is not None and m.role != "tool":
      raise bad_request(f"messages[{i}].tool_call_id: only a 'tool' message has one.",
                        f"messages[{i}].tool_call_id")
    if m.role == "tool":
      if m.tool_call_id is None:
        raise bad_request(f"Missing required parameter: 'messages[{i}].tool_call_id'.",
                          f"messages[{i}].tool_call_id")
      if m.tool_call_id not in open_ids:
        raise bad_request(f"Invalid parameter: messages[{i}] with role 'tool' must be a "
                          "response to a preceding message with 'tool_calls' (no call id "
                          f"{m.tool_call_id!r} there).", f"messages[{i}]")
      if m.content is None:
        raise bad_request(f"messages[{i}].content is null: a 'tool' message needs content.",
                          f"messages[{i}].content")
      continue
    open_ids = {c.id for c in m.tool_calls or ()}


def _check_schema(schema: dict[str, Any], param: str) -> None:
  """A function's `parameters`: a JSON Schema whose instances are objects."""
  kind = schema.get("type", "object")
  if kind != "object":
    raise bad_request(f"Invalid schema for function parameters '{param}': the schema must be "
                      f"of type 'object', got {json.dumps(kind)[:40]}.", param)
  try:
    import jsonschema  # pylint: disable=import-outside-toplevel
  except ImportError:  # the meta-schema check needs it: kvjax[structured]
    return
  try:
    jsonschema.validators.validator_for(schema).check_schema(schema)
  except jsonschema.SchemaError as e:
    where = "/".join(str(p) for p in e.absolute_path) or "(root)"
    raise bad_request(f"Invalid schema for function parameters '{param}': {e.message} (at "
                      f"{where}).", param) from None


def text_chars(req: protocol.ChatCompletionRequest) -> int:
  """Characters of the request's text before rendering: message content, calls' names and
  arguments, and the tools' JSON (the length cap before tokenizing,
  `completions.check_prompt_chars`)."""
  n = sum(len(m.text()) for m in req.messages)
  n += sum(len(c.function.name) + len(c.function.arguments)
           for m in req.messages for c in m.tool_calls or ())
  return n + (len(tools_text(req.tools)) if req.tools else 0)


def parses_calls(req: protocol.ChatCompletionRequest) -> bool:
  """Whether the reply is read for tool calls: tools given and `tool_choice` not "none"."""
  return bool(req.tools) and req.tool_choice != "none"


# ------------------------------------------------------------------------------- rendering
def tools_text(tools: Sequence[protocol.Tool]) -> str:
  """The tools block of the system message (see the module docstring)."""
  lines = [json.dumps(t.model_dump(exclude_none=True), ensure_ascii=False) for t in tools]
  return "\n".join([TOOLS_HEADER, *lines, TOOLS_FOOTER])


def call_text(name: str, arguments: str) -> str:
  """The canonical text of one call (arguments verbatim, as the client sent them)."""
  return (f'{TOOL_CALL_OPEN}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": '
          f'{arguments}}}\n{TOOL_CALL_CLOSE}')


def _assistant_text(m: protocol.ChatMessage, last: ParsedReply | None,
                    last_reply: str | None) -> str:
  content = m.text()
  if not m.tool_calls:
    return content
  calls = tuple(ParsedCall(c.function.name, c.function.arguments) for c in m.tool_calls)
  if last is not None and last.calls and last.calls == calls and (
      (last.content or "") == content):
    return last_reply  # the reply as generated: the session's ids extend
  text = "".join(call_text(c.name, c.arguments) for c in calls)  # back to back
  return f"{content}\n{text}" if content else text


def render_conversation(req: protocol.ChatCompletionRequest,
                        last_reply: str | None = None) -> list[dict[str, str]]:
  """The conversation as the chat template takes it: `[{"role", "content"}, ...]`, tools,
  calls and results rendered as text (module docstring); role "developer" is "system".

  Args:
    req: the request (checked by `check_request`).
    last_reply: the session's last reply as generated (`Turn.output_text`), or None: an
      assistant message carrying exactly its content and calls is rendered as it.
  """
  last = parse_reply(last_reply, None) if last_reply is not None else None
  out: list[dict[str, str]] = []
  for m in req.messages:
    role = "system" if m.role == "developer" else m.role
    if role == "tool":
      block = f"<tool_response>\n{m.text()}\n</tool_response>"
      if out and out[-1].get("_tool"):
        out[-1]["content"] += "\n" + block
      else:
        out.append({"role": "user", "content": block, "_tool": True})
      continue
    text = _assistant_text(m, last, last_reply) if role == "assistant" else m.text()
    out.append({"role": role, "content": text})
  out = [{"role": m["role"], "content": m["content"]} for m in out]
  if req.tools:
    block = tools_text(req.tools)
    if out and out[0]["role"] == "system":
      out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{block}"}
    else:
      out.insert(0, {"role": "system", "content": block})
  return out


# ------------------------------------------------------------------------------- parsing
def parse_reply(text: str, names: Sequence[str] | None, *,
                parallel: bool = True) -> ParsedReply:
  """Reads the tool calls of a reply (module docstring).

  Args:
    text: the reply as generated.
    names: the functions a call may name; None: any name.
    parallel: False keeps only the first call (`parallel_tool_calls=false`).

  Returns:
    `ParsedReply`: no calls (and `text` whole as content) when there is no block or one does not
    parse; else the text before the first block (stripped; None when empty) and the calls.
  """
  start = text.find(TOOL_CALL_OPEN)
  if start < 0:
    return ParsedReply(text, ())
  calls = []
  for m in _BLOCK_RE.finditer(text, start):
    try:
      obj = json.loads(m.group(1))
    except ValueError:
      return ParsedReply(text, ())
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or (
        names is not None and obj["name"] not in names):
      return ParsedReply(text, ())
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
      try:
        args = json.loads(args)
      except ValueError:
        return ParsedReply(text, ())
    if not isinstance(args, dict):
      return ParsedReply(text, ())
    calls.append(ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False)))
  content = text[:start].strip() or None
  return ParsedReply(content, tuple(calls[:1] if not parallel else calls))


def new_call_id() -> str:
  """A tool call's id, OpenAI's shape ("call_" and 24 hex digits)."""
  return f"call_{uuid.uuid4().hex[:24]}"


def message_calls(calls: Sequence[ParsedCall]) -> list[dict[str, Any]]:
  """A response message's `tool_calls`, each with a new id."""
  return [{"id": new_call_id(), "type": "function",
           "function": {"name": c.name, "arguments": c.arguments}} for c in calls]


class CallStream:
  """The streamed side of `parse_reply`: text deltas pass through until a `<tool_call>` could
  be starting (a suffix that is a prefix of it, and trailing whitespace, are held back); from the first block on nothing
  more is streamed as content, and `finish` parses the whole reply: its calls as
  `delta.tool_calls` entries (`index`, `id`, `type`, `function` with the whole `arguments`),
  or, when it holds none, the held-back text as content.

  Args:
    names: the functions a call may name.
    parallel: as `parse_reply`.
  """

  def __init__(self, names: Sequence[str], parallel: bool):
    self.names, self.parallel = tuple(names), parallel
    self._text = ""
    self._sent = 0  # characters of `_text` streamed as content
    self._in_call = False

  def update(self, delta: str) -> str:
    """Takes the next text delta; returns the content to stream now."""
    self._text += delta
    if self._in_call:
      return ""
    at = self._text.find(TOOL_CALL_OPEN, self._sent)
    if at >= 0:
      self._in_call = True
      end = max(self._sent, len(self._text[:at].rstrip()))  # the body's content is stripped
      out, self._sent = self._text[self._sent:end], end
      return out
    end = len(self._text)
    for k in range(min(len(TOOL_CALL_OPEN) - 1, end - self._sent), 0, -1):
      if self._text.endswith(TOOL_CALL_OPEN[:k]):
        end -= k
        break
    end = max(self._sent, len(self._text[:end].rstrip()))  # whitespace may precede a call
    out, self._sent = self._text[self._sent:end], end
    return out

  def finish(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
    """Takes the last delta; returns (content still to stream, `delta.tool_calls` entries)."""
    self._text += delta
    parsed = parse_reply(self._text, self.names, parallel=self.parallel)
    if not parsed.calls:
      out, self._sent = self._text[self._sent:], len(self._text)
      return out, []
    return "", [{"index": i, **c} for i, c in enumerate(message_calls(parsed.calls))]
