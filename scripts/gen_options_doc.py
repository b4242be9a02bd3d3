r"""Generates docs/usage/options.md, the options reference, from the code.

    python scripts/gen_options_doc.py            # rewrite docs/usage/options.md
    python scripts/gen_options_doc.py --check    # exit 1 if the checked-in page is stale

The sources are the server's absl flags (`kvjax/serve/__main__.py`) and the `LLM(...)`
constructor (`kvjax/engine/llm.py`: its signature for names and defaults, the "Args:" section
of the class docstring for the text). `collect_options` is the one function that reads them;
`render` turns its plain `Option` records into Markdown. When the options move to one
configuration tree, only `collect_options` changes.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib
import inspect
import os
import re
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(REPO, "docs", "usage", "options.md")

#: The module that defines the server's flags, as absl records it.
SERVER_FLAGS_MODULE = "kvjax.serve.__main__"

#: Text that must not reach the page: references to issue numbers (`issue 11`, `issue 14, part 4`)
#: written in docstrings for the project's own tracker.
_ISSUE = r"issue \d+(?:, part \d+)?"
_ISSUE_REFS = ((re.compile(rf"\s*\({_ISSUE}\)"), ""),            # "(issue 14)"
               (re.compile(rf"\({_ISSUE}[:,]\s*"), "("),           # "(issue 11: ...)"
               (re.compile(rf"\b{_ISSUE}[:,]?\s*"), ""))           # a bare mention


@dataclasses.dataclass(frozen=True)
class Option:
  """One option as the page shows it.

  Attributes:
    name: the `LLM(...)` keyword, or the flag's name for a server-only flag.
    llm_default: `repr` of the `LLM(...)` default, or None when `LLM` has no such keyword.
    flag_default: the server flag's default as absl prints it, or None when there is no flag.
    text: what it does (the `LLM` docstring's entry, else the flag's help).
    flag_text: the flag's help when it adds to `text` (server-only notes), else "".
  """
  name: str
  llm_default: str | None
  flag_default: str | None
  text: str
  flag_text: str = ""


def _docstring_args(doc: str) -> dict[str, str]:
  """The "Args:" entries of an absl-style docstring, one line each, by name.

  An entry naming several arguments (`a, b, c: text`) is given to each of them.
  """
  lines = inspect.cleandoc(doc).splitlines()
  out: dict[str, str] = {}
  try:
    start = lines.index("Args:") + 1
  except ValueError:
    return out
  names: list[str] = []
  for line in lines[start:]:
    if line and not line.startswith(" "):  # the next section ("Raises:")
      break
    m = re.match(r"^  ([a-z_][a-z0-9_, ]*):\s*(.*)$", line)
    if m:
      names = [n.strip() for n in m.group(1).split(",")]
      for n in names:
        out[n] = m.group(2)
    elif line.strip() and names:
      for n in names:
        out[n] += " " + line.strip()
  return out


def _scrub(text: str) -> str:
  for pattern, repl in _ISSUE_REFS:
    text = pattern.sub(repl, text)
  return re.sub(r"\s+", " ", text).strip()


def _flag_default(flag) -> str:
  if flag.default is None:  # resolved at start-up: the help text's "default: ..." says to what
    m = re.search(r"[Dd]efault:? ([^;)]*)", flag.help or "")
    return m.group(1).split(". ")[0].rstrip(".").strip() if m else "none"
  if isinstance(flag.default, bool):
    return "true" if flag.default else "false"
  if isinstance(flag.default, list):
    return ",".join(str(v) for v in flag.default) or "(empty)"
  return str(flag.default)


def collect_options() -> list[Option]:
  """Every option of `LLM(...)` and of the server, from today's sources.

  Order: `LLM(...)`'s keywords in signature order (with their server flag, when one has the same
  name), then the flags of the server alone in definition order.
  """
  from absl import flags
  from kvjax.engine.llm import LLM
  importlib.import_module(SERVER_FLAGS_MODULE)
  server_flags = {f.name: f for f in flags.FLAGS.flags_by_module_dict()[SERVER_FLAGS_MODULE]}
  docs = _docstring_args(LLM.__doc__ or "")
  options: list[Option] = []
  for name, param in inspect.signature(LLM.__init__).parameters.items():
    if name == "self":
      continue
    flag = server_flags.pop(name, None)
    default = param.default
    options.append(Option(
        name=name,
        llm_default=repr(default),
        flag_default=None if flag is None else _flag_default(flag),
        text=_scrub(docs.get(name, "")),
        flag_text="" if flag is None else _scrub(flag.help)))
  for name, flag in server_flags.items():
    options.append(Option(name=name, llm_default=None, flag_default=_flag_default(flag),
                          text=_scrub(flag.help)))
  return options


def _cell(text: str) -> str:
  return text.replace("|", "\\|")


def render(options: list[Option]) -> str:
  """The options page (Markdown) of `options`."""
  shared = [o for o in options if o.llm_default is not None]
  server_only = [o for o in options if o.llm_default is None]
  out = [
      "# Options reference",
      "",
      "<!-- Generated by scripts/gen_options_doc.py from the server's flags and LLM(...)'s",
      "     signature and docstring. Do not edit by hand: change the code, then run",
      "     `python scripts/gen_options_doc.py`. -->",
      "",
      "Every option of `LLM(...)` and of `python -m kvjax.serve`. A keyword of `LLM(...)` with",
      "a server flag of the same name takes `--name=value` on the command line (absl style;",
      "booleans also as `--name` / `--noname`). The server's defaults can differ from",
      "`LLM(...)`'s: the server runs a store and more sequences by default. What the options",
      "do in context: [Python API](python.md), [Serve](serve.md),",
      "[Stores and tiers](stores.md), [Codecs](codecs.md), [Sessions](sessions.md),",
      "[Scale out](scale-out.md).",
      "",
      "## `LLM(...)` keywords and their server flags",
      "",
      "| option | `LLM` default | server flag default | what it does |",
      "| --- | --- | --- | --- |",
  ]
  for o in shared:
    flag = "(no flag)" if o.flag_default is None else f"`{_cell(o.flag_default)}`"
    text = o.text or o.flag_text
    out.append(f"| `{o.name}` | `{_cell(o.llm_default)}` | {flag} | {_cell(text)} |")
  out += [
      "",
      "## Server-only flags",
      "",
      "| flag | default | what it does |",
      "| --- | --- | --- |",
  ]
  for o in server_only:
    out.append(f"| `--{o.name}` | `{_cell(o.flag_default)}` | {_cell(o.text)} |")
  out.append("")
  return "\n".join(out)


def main(argv: list[str]) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--check", action="store_true",
                      help="compare with the checked-in page; exit 1 if it differs")
  args = parser.parse_args(argv)
  text = render(collect_options())
  if args.check:
    with open(PAGE, encoding="utf-8") as f:
      checked_in = f.read()
    if checked_in != text:
      diff = difflib.unified_diff(checked_in.splitlines(), text.splitlines(), "checked in",
                                  "generated", lineterm="", n=0)
      print("\n".join(list(diff)[:40]), file=sys.stderr)
      print(f"{os.path.relpath(PAGE, REPO)} is stale: run python scripts/gen_options_doc.py",
            file=sys.stderr)
      return 1
    return 0
  with open(PAGE, "w", encoding="utf-8") as f:
    f.write(text)
  print(f"wrote {os.path.relpath(PAGE, REPO)} ({text.count(chr(10))} lines)")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
