"""Holds the import direction between rooms (DESIGN.md section 2).

Bottom floors (`kvjax/_typing.py`, `kvjax/_paths.py`, `kvjax/codecs.py`, the codec registry,
`kvjax/block_hash.py`) import no kvjax module but `kvjax._typing` and no array or storage library, so every room may import them.
"""

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
    "storage": {"kvjax.models", "kvjax.kernels", "kvjax.engine", "kvjax.serve", "kvjax.scheduler",
                "kvjax.testing", "jax", "flax"},
    "models": {"kvjax.storage", "kvjax.scheduler", "kvjax.engine", "kvjax.serve",
               "kvjax.testing"},
    "engine": {"kvjax.serve", "kvjax.testing"},
    "serve": {"kvjax.testing", "jax", "flax", "tensorstore"},
    # The operator CLI works on stores through the storage room, never through an engine.
    "store": {"kvjax.models", "kvjax.kernels", "kvjax.scheduler", "kvjax.engine", "kvjax.serve",
              "kvjax.testing", "jax", "flax"},
}

# Bottom-floor modules -> the only kvjax modules they may import, and the libraries they must not.
BOTTOM_FLOORS = {"_typing.py": set(), "_paths.py": set(), "codecs.py": {"kvjax._typing"},
                 "block_hash.py": {"kvjax._typing"}}
BOTTOM_FORBIDDEN = {"jax", "flax", "tensorstore", "numpy", "zstandard", "pcodec"}

# Room -> the only kvjax modules it may import (besides itself): serve sees the engine and the
# request types, nothing below them.
ALLOWED_KVJAX = {
    "serve": {"kvjax.serve", "kvjax.engine", "kvjax.scheduler.request", "kvjax._typing",
              "kvjax.codecs"},
    "store": {"kvjax.store", "kvjax.storage", "kvjax.codecs", "kvjax._typing", "kvjax._paths"},
}


def imported_modules(path):
  tree = ast.parse(path.read_text(), filename=str(path))
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      yield from (a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module == "kvjax" and not node.level:
      yield from (f"kvjax.{a.name}" for a in node.names)  # from kvjax import codecs
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

  def test_bottom_floors_import_nothing_above_them(self):
    violations = []
    for name, allowed in BOTTOM_FLOORS.items():
      for mod in imported_modules(PKG / name):
        top = mod.split(".")[0]
        if (top == "kvjax" and mod not in allowed) or top in BOTTOM_FORBIDDEN:
          violations.append(f"kvjax/{name} imports {mod}")
    self.assertEqual(violations, [])

  def test_the_codec_rooms_read_the_registry(self):
    # Kernels (the math) and storage (the byte format) take codec ids, levels and the chunk-size
    # rule from kvjax.codecs, so they cannot disagree.
    for path in ("kernels/kv_codec.py", "storage/codecs.py"):
      self.assertIn("kvjax.codecs", set(imported_modules(PKG / path)), path)

  def test_rooms_exist(self):
    for room in ("kernels", "scheduler", "models", "engine", "storage", "serve", "store"):
      self.assertTrue((PKG / room / "__init__.py").is_file(), room)
    for name in BOTTOM_FLOORS:
      self.assertTrue((PKG / name).is_file(), name)


if __name__ == "__main__":
  absltest.main()
