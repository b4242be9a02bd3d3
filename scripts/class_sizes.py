"""Prints the largest classes of `kvjax/`: lines, methods and attributes, bases included.

A class counts together with every base class defined in `kvjax/` (a mixin's lines, methods and
attributes are its user's: one object holds them). Lines are the class bodies' source lines,
methods the distinct `def`s, attributes the distinct names assigned as `self.<name>` in them.
Standard library only; reads the source, imports nothing of kvjax.

Usage: python scripts/class_sizes.py [--top N] [--root DIR]
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import os


@dataclasses.dataclass
class ClassInfo:
  name: str
  path: str
  bases: list[str]
  lines: int
  methods: set[str]
  attributes: set[str]


def classes(root: str) -> dict[str, list[ClassInfo]]:
  """Every class under `root` by its name (names may repeat across modules)."""
  out: dict[str, list[ClassInfo]] = {}
  for d, _, files in os.walk(root):
    for f in sorted(files):
      if not f.endswith(".py"):
        continue
      path = os.path.join(d, f)
      with open(path, encoding="utf-8") as fh:
        tree = ast.parse(fh.read(), path)
      for node in ast.walk(tree):
        if not isinstance(node, ast.ClassDef):
          continue
        methods = {n.name for n in node.body
                   if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        attrs = set()
        for n in ast.walk(node):
          targets = (n.targets if isinstance(n, ast.Assign)
                     else [n.target] if isinstance(n, (ast.AnnAssign, ast.AugAssign)) else [])
          for t in targets:
            if (isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                and t.value.id == "self"):
              attrs.add(t.attr)
        bases = [b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute)
                 else "" for b in node.bases]
        out.setdefault(node.name, []).append(ClassInfo(
            node.name, os.path.relpath(path, os.path.dirname(root)), bases,
            node.end_lineno - node.lineno + 1, methods, attrs))
  return out


def with_bases(info: ClassInfo, by_name: dict[str, list[ClassInfo]]) -> tuple[int, int, int]:
  """(lines, methods, attributes) of `info` and its bases defined under the root."""
  seen, todo = [], [info]
  while todo:
    c = todo.pop()
    if any(c is s for s in seen):
      continue
    seen.append(c)
    todo += [by_name[b][0] for b in c.bases if b in by_name and len(by_name[b]) == 1]
  return (sum(c.lines for c in seen), len(set().union(*(c.methods for c in seen))),
          len(set().union(*(c.attributes for c in seen))))


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--top", type=int, default=15)
  ap.add_argument("--root", default=os.path.join(os.path.dirname(__file__), "..", "kvjax"))
  args = ap.parse_args()
  by_name = classes(os.path.normpath(args.root))
  rows = sorted(((with_bases(c, by_name), c) for cs in by_name.values() for c in cs),
                key=lambda r: -r[0][0])
  print(f"{'class':<28} {'lines':>5} {'methods':>7} {'attrs':>5}  file")
  for (lines, methods, attrs), c in rows[:args.top]:
    print(f"{c.name:<28} {lines:>5} {methods:>7} {attrs:>5}  {c.path}")


if __name__ == "__main__":
  main()
