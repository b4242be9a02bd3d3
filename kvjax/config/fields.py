"""How an option is declared: one dataclass field with its default, its text and its flag.

    max_num_seqs: int = option(4, "decode slots (requests running at once).",
                               flag_help="Requests running at once ...", server_default=64)

`option` puts the text and the command-line details in the field's metadata; `OptionSpec` reads
them back. The server (`kvjax/serve/__main__.py`) defines one absl flag per field from them, and
`scripts/gen_options_doc.py` writes docs/usage/options.md from the same records.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

#: Flag kinds: the absl `DEFINE_*` each maps to.
FLAG_KINDS = ("string", "integer", "float", "bool", "enum", "list")

_KEY = "kvjax_option"
_NO_DEFAULT = object()


@dataclasses.dataclass(frozen=True)
class OptionSpec:
  """One option's text and command-line details (a field's metadata, read by `spec`).

  Attributes:
    name: the field's name: the `LLM(...)` keyword and the server flag (`--name`).
    doc: what the option does (the options page's text; `LLM`'s reference).
    flag: the flag's kind, one of `FLAG_KINDS`; None: no flag.
    flag_help: the flag's help text (`--help`); "" : `doc`.
    choices: the values of an "enum" flag.
    flag_default: the flag's default when it differs from the field's (e.g. "auto" for None).
    parse: the flag's value -> the field's value (e.g. -1 -> None); None: as given.
    server_default: the server's default when it differs from `LLM`'s (`_NO_DEFAULT`: none).
  """

  name: str
  doc: str
  flag: str | None
  flag_help: str
  choices: tuple[str, ...] | None
  flag_default: Any
  parse: Callable[[Any], Any] | None
  server_default: Any = _NO_DEFAULT

  @property
  def has_server_default(self) -> bool:
    return self.server_default is not _NO_DEFAULT

  @property
  def help(self) -> str:
    """The flag's help: `flag_help`, else `doc`."""
    return self.flag_help or self.doc


def option(default: Any = _NO_DEFAULT, doc: str = "", *, flag: str | None = None,
           flag_help: str = "", choices: Sequence[str] | None = None,
           flag_default: Any = _NO_DEFAULT, parse: Callable[[Any], Any] | None = None,
           server_default: Any = _NO_DEFAULT, default_factory: Callable[[], Any] | None = None,
           repr: bool = True) -> Any:  # noqa: A002 - dataclasses.field's name
  """A dataclass field declaring one option (see `OptionSpec` for the arguments).

  `flag` defaults to the kind the default's type implies ("bool", "integer", "float",
  "string"; "enum" when `choices` are given).

  Raises:
    ValueError: an unknown flag kind, or no text.
  """
  if not doc:
    raise ValueError("an option needs its text (doc)")
  if flag is None:
    value = default_factory() if default_factory is not None else default
    if choices is not None:
      flag = "enum"
    elif isinstance(value, bool):
      flag = "bool"
    elif isinstance(value, int):
      flag = "integer"
    elif isinstance(value, float):
      flag = "float"
    else:
      flag = "string"
  if flag not in FLAG_KINDS:
    raise ValueError(f"flag kind {flag!r} is not one of {FLAG_KINDS}")
  meta = {_KEY: dict(doc=doc, flag=flag, flag_help=flag_help,
                     choices=None if choices is None else tuple(choices),
                     flag_default=flag_default, parse=parse, server_default=server_default)}
  if default_factory is not None:
    return dataclasses.field(default_factory=default_factory, metadata=meta, repr=repr)
  return dataclasses.field(default=default, metadata=meta, repr=repr)


def spec(field: dataclasses.Field) -> OptionSpec | None:
  """The `OptionSpec` of a field declared with `option`, else None."""
  meta = field.metadata.get(_KEY)
  if meta is None:
    return None
  return OptionSpec(name=field.name, **meta)


def field_default(field: dataclasses.Field) -> Any:
  """A field's default value (calling its default factory)."""
  if field.default_factory is not dataclasses.MISSING:
    return field.default_factory()
  return field.default


def flag_default(field: dataclasses.Field) -> Any:
  """The default of a field's flag: its `flag_default`, else the server's, else the field's."""
  s = spec(field)
  if s.flag_default is not _NO_DEFAULT:
    return s.flag_default
  if s.has_server_default:
    return s.server_default
  value = field_default(field)
  if isinstance(value, tuple):
    return list(value)
  return value


def option_fields(cls) -> list[dataclasses.Field]:
  """The fields of an options dataclass declared with `option`, in declaration order."""
  return [f for f in dataclasses.fields(cls) if spec(f) is not None]
