"""Holds the import direction between rooms (DESIGN.md section 2)."""

import ast
import pathlib

from absl.testing import absltest

PKG = pathlib.Path(__file__).resolve().parent.parent / "kvjax"

# Room -> top-level modules (kvjax rooms or third-party packages) it must not import.
FORBIDDEN = {
    "kernels": {"kvjax.models", "kvjax.storage", "kvjax.scheduler", "kvjax.engine", "kvjax.serve",
                "kvjax.testing", "flax", "tensorstore"},
    "scheduler": {"kvjax.models", "kvjax.kernels", "kvjax.storage", "kvjax.engine", "kvjax.serve",
                  "kvjax.testing", "jax", "flax", "tensorstore"},
    "storage": {"kvjax.models", "kvjax.engine", "kvjax.serve", "kvjax.scheduler", "kvjax.testing",
                "flax"},
    "models": {"kvjax.storage", "kvjax.scheduler", "kvjax.engine", "kvjax.serve",
               "kvjax.testing"},
    "engine": {"kvjax.serve", "kvjax.testing"},
    "serve": {"kvjax.testing", "jax", "flax", "tensorstore"},
}

# Room -> the only kvjax modules it may import (besides itself): serve sees the engine and the
# request types, nothing below them.
ALLOWED_KVJAX = {
    "serve": {"kvjax.serve", "kvjax.engine", "kvjax.scheduler.request", "kvjax._typing"},
}

# Bottom floors: kvjax modules outside every room that any room may import (the scheduler and
# storage both hash blocks with kvjax.block_hash); a floor imports no room, only other floors.
FLOORS = {"kvjax._typing", "kvjax.block_hash"}


def imported_modules(path):
  tree = ast.parse(path.read_text(), filename=str(path))
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      yield from (a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
      yield node.module


class LayeringTest(absltest.TestCase):

  def test_rooms_import_only_downstream(self):
    violations = []
    for room, forbidden in FORBIDDEN.items():
      for path in sorted((PKG / room).rglob("*.py")):
        for mod in imported_modules(path):
          if any(mod == f or mod.startswith(f + ".") for f in forbidden):
            violations.append(f"{path.relative_to(PKG.parent)} imports {mod}")
    self.assertEqual(violations, [])

  def test_rooms_import_only_allowed_kvjax_modules(self):
    violations = []
    for room, allowed in ALLOWED_KVJAX.items():
      for path in sorted((PKG / room).rglob("*.py")):
        for mod in imported_modules(path):
          if (mod == "kvjax" or mod.startswith("kvjax.")) and not any(
              mod == a or mod.startswith(a + ".") for a in allowed):
            violations.append(f"{path.relative_to(PKG.parent)} imports {mod}")
    self.assertEqual(violations, [])

  def test_floors_import_no_room(self):
    violations = []
    for floor in sorted(FLOORS):
      path = PKG.parent / (floor.replace(".", "/") + ".py")
      for mod in imported_modules(path):
        if (mod == "kvjax" or mod.startswith("kvjax.")) and mod not in FLOORS:
          violations.append(f"{path.relative_to(PKG.parent)} imports {mod}")
    self.assertEqual(violations, [])

  def test_rooms_exist(self):
    for room in ("kernels", "scheduler", "models", "engine", "storage", "serve"):
      self.assertTrue((PKG / room / "__init__.py").is_file(), room)


if __name__ == "__main__":
  absltest.main()
