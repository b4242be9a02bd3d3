"""Structured output on the chat endpoint: `response_format` (`json_object`, `json_schema`) and
forced tool calls (`tool_choice` "required" or a named function) as a grammar the engine decodes
under (`kvjax.scheduler.request.StructuredOutput`, `kvjax/engine/grammar.py`, llguidance).

A forced call is generated in the format the prompt asks for (`kvjax/serve/tool_calls.py`):

    <tool_call>\\n{"name": NAME, "arguments": ARGUMENTS}\\n</tool_call>   (calls back to back)

where the JSON is one of the tools' objects (`name` the function's, `arguments` valid for its
`parameters`), written with `json.dumps`' separators: exactly `tool_calls.call_text`, so the
canonical rendering of the call in the next turn's history is the text that was generated.
Parallel calls follow each other with no separator: after a call the grammar allows the end of
the reply or the `<` of the next call, not the newline a model tends to write after a closing
tag (with a newline allowed between calls, greedy SmolLM2 wrote its one call twice).
"""

from __future__ import annotations

import json
from typing import Any

from kvjax.engine import grammar
from kvjax.scheduler.request import StructuredOutput
from kvjax.serve import protocol
from kvjax.serve.protocol import bad_request


def _need_library(what: str, param: str) -> None:
  if not grammar.available():
    raise bad_request(f"{what} needs constrained decoding: `{grammar.INSTALL_HINT}` on the "
                      "server.", param)


def _forced_function(req: protocol.ChatCompletionRequest) -> list[protocol.Tool] | None:
  """The tools a forced call may name: all ("required"), one (named), or None (not forced)."""
  choice = req.tool_choice
  if choice == "required":
    return list(req.tools)
  if isinstance(choice, protocol.NamedToolChoice):
    return [t for t in req.tools if t.function.name == choice.function.name]
  return None


def tool_call_grammar(tools: list[protocol.Tool], parallel: bool) -> str:
  """The Lark grammar (llguidance's dialect) of one or more forced calls of `tools`."""
  options = [{"type": "object", "properties": {
      "name": {"const": t.function.name},
      "arguments": t.function.parameters if t.function.parameters is not None
      else {"type": "object"}},
      "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
  schema = options[0] if len(options) == 1 else {"anyOf": options}
  schema = {"x-guidance": grammar.JSON_OPTIONS, **schema}  # no free whitespace, as json.dumps
  start = "start: call+" if parallel else "start: call"
  return "\n".join([start, 'call: "<tool_call>\\n" body "\\n</tool_call>"',
                    f"body: %json {json.dumps(schema, ensure_ascii=False)}"])


def structured_output(req: protocol.ChatCompletionRequest) -> StructuredOutput | None:
  """The grammar a chat reply is decoded under, or None (free text).

  Raises:
    ApiError: 400 naming `response_format` or `tool_choice`: llguidance is not installed; a
      `json_schema` format without its schema, or with a schema the grammar compiler rejects;
      `response_format` other than "text" together with a forced tool call.
  """
  fmt = req.response_format
  tools = _forced_function(req) if req.tools else None
  if fmt is not None and fmt.type != "text" and tools is not None:
    raise bad_request("response_format and a forced tool call (tool_choice 'required' or a "
                      "named function) cannot be combined: give one.", "response_format")
  if tools is not None:
    _need_library("tool_choice 'required' or a named function", "tool_choice")
    spec = StructuredOutput(lark=tool_call_grammar(tools, req.parallel_tool_calls is not False))
    param = "tool_choice"
  elif fmt is None or fmt.type == "text":
    return None
  elif fmt.type == "json_object":
    _need_library("response_format", "response_format")
    spec, param = StructuredOutput(json_schema='{"type": "object"}'), "response_format"
  else:
    _need_library("response_format", "response_format")
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
      raise bad_request("response_format of type 'json_schema' needs "
                        "'json_schema.schema'.", "response_format.json_schema")
    _check_meta_schema(fmt.json_schema.schema_)
    spec = StructuredOutput(json_schema=json.dumps(fmt.json_schema.schema_, ensure_ascii=False))
    param = "response_format.json_schema.schema"
  try:
    grammar.grammar_text(spec)
  except ValueError as e:
    raise bad_request(f"Invalid '{param}': {e}.", param) from None
  return spec


def _check_meta_schema(schema: dict[str, Any]) -> None:
  """`jsonschema`'s meta-schema check (part of kvjax[structured])."""
  try:
    import jsonschema  # pylint: disable=import-outside-toplevel
  except ImportError:
    return
  try:
    jsonschema.validators.validator_for(schema).check_schema(schema)
  except jsonschema.SchemaError as e:
    raise bad_request(f"Invalid 'response_format.json_schema.schema': {e.message}.",
                      "response_format.json_schema.schema") from None
