"""Parts own their state: no mixins in `kvjax/`.

A mixin shares one object's attributes with the classes it is mixed into, so nobody can tell
who writes what (docs/contributing/index.md, Conventions: ownership). Two rules, read from the
source (no import):

  * no class is named `*Mixin` or inherits from one;
  * no class's methods use an attribute (`self.x`) that neither it nor its bases define, but a
    class built on it does: a base reaching into state its subclass (or a sibling base) owns.

Defined means: a method or class-level name of the class, or an attribute its methods assign
(`self.x = ...`). Bases are resolved by name among the classes of `kvjax/`.
"""

from __future__ import annotations

import ast
import os
import pathlib
import textwrap

from absl.testing import absltest

PKG = pathlib.Path(__file__).resolve().parents[2] / "kvjax"


class _Class:

  def __init__(self, node: ast.ClassDef, path: str):
    self.name, self.path = node.name, path
    self.bases = [b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute)
                  else "" for b in node.bases]
    self.defines: set[str] = set()
    self.uses: set[str] = set()
    for n in node.body:
      if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        self.defines.add(n.name)
      elif isinstance(n, ast.Assign):
        self.defines |= {t.id for t in n.targets if isinstance(t, ast.Name)}
      elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
        self.defines.add(n.target.id)
    for fn in node.body:
      if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        continue
      for n in ast.walk(fn):
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self":
          (self.defines if isinstance(n.ctx, ast.Store) else self.uses).add(n.attr)


def classes(root: pathlib.Path) -> dict[str, list[_Class]]:
  """Every class under `root`, by name."""
  out: dict[str, list[_Class]] = {}
  for path in sorted(root.rglob("*.py")):
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    for node in ast.walk(tree):
      if isinstance(node, ast.ClassDef):
        out.setdefault(node.name, []).append(_Class(node, str(path.relative_to(root.parent))))
  return out


def problems(root: pathlib.Path) -> list[str]:
  """The mixins under `root`, one line each."""
  by_name = classes(root)
  flat = [c for cs in by_name.values() for c in cs]

  def ancestors(c: _Class) -> list[_Class]:
    out, todo = [], [c]
    while todo:
      x = todo.pop()
      if any(x is y for y in out):
        continue
      out.append(x)
      todo += [b for name in x.bases for b in by_name.get(name, ())]
    return out

  def defined(c: _Class) -> set[str]:
    return set().union(*(a.defines for a in ancestors(c)))

  found = []
  for c in flat:
    for name in [c.name] + c.bases:
      if name.endswith("Mixin"):
        found.append(f"{c.path}: {c.name} is or inherits from a mixin ({name})")
        break
    own = defined(c)
    for sub in flat:
      if sub is c or not any(a is c for a in ancestors(sub)):
        continue
      borrowed = sorted((c.uses - own) & defined(sub))
      if borrowed:
        found.append(f"{c.path}: {c.name} uses {borrowed}, which only {sub.name} (built on it) "
                     "defines")
  return found


class NoMixinsTest(absltest.TestCase):

  def test_no_class_in_kvjax_is_a_mixin(self):
    self.assertEqual(problems(PKG), [])

  def test_the_check_finds_a_mixin(self):
    root = pathlib.Path(self.create_tempdir().full_path) / "pkg"
    os.makedirs(root)
    (root / "a.py").write_text(textwrap.dedent("""
        class SaverMixin:
          def submit(self, job):
            with self._lock:
              self._jobs.append(job)

        class Mover:
          def move(self):
            return self._reading

        class Store(Mover):
          def __init__(self):
            self._reading = {}

        class Client(SaverMixin):
          def __init__(self):
            self._lock, self._jobs = None, []

        class Part:
          def __init__(self):
            self._lock = None
          def run(self):
            return self._lock
    """))
    self.assertEqual(problems(root), [
        "pkg/a.py: SaverMixin is or inherits from a mixin (SaverMixin)",
        "pkg/a.py: SaverMixin uses ['_jobs', '_lock'], which only Client (built on it) defines",
        "pkg/a.py: Mover uses ['_reading'], which only Store (built on it) defines",
        "pkg/a.py: Client is or inherits from a mixin (SaverMixin)",
    ])


if __name__ == "__main__":
  absltest.main()
