"""Holds the import direction between rooms (docs/architecture.md).

Bottom floors (`kvjax/_typing.py`, `kvjax/_paths.py`, `kvjax/codecs.py`, the codec registry,
`kvjax/block_hash.py`, with the chunk-is-whole-blocks and last-token rules, `kvjax/merge_mode.py`,
the merge modes) import no kvjax module but `kvjax._typing` and no array or storage library, so
every room may import them.
"""

import ast
import pathlib

from absl.testing import absltest

PKG = pathlib.Path(__file__).resolve().parents[2] / "kvjax"

# Room -> top-level modules (kvjax rooms or third-party packages) it must not import.
FORBIDDEN = {
    "kernels": {"kvjax.models", "kvjax.storage", "kvjax.scheduler", "kvjax.engine", "kvjax.serve",
                "kvjax.sessions", "kvjax.testing", "flax", "tensorstore"},
    "scheduler": {"kvjax.models", "kvjax.kernels", "kvjax.storage", "kvjax.engine", "kvjax.serve",
                  "kvjax.sessions", "kvjax.testing", "jax", "flax", "tensorstore"},
    "storage": {"kvjax.models", "kvjax.kernels", "kvjax.engine", "kvjax.serve", "kvjax.scheduler",
                "kvjax.sessions", "kvjax.testing", "jax", "flax"},
    "models": {"kvjax.storage", "kvjax.scheduler", "kvjax.engine", "kvjax.serve",
               "kvjax.sessions", "kvjax.testing"},
    # Chat sessions (the registry, the extension rule, truncation, session files and the one
    # session-turn flow, `run_turn`) are plain Python over plain records: the engine and the
    # server import them, they import no other room and no array library.
    "sessions": {"kvjax.models", "kvjax.kernels", "kvjax.storage", "kvjax.scheduler",
                 "kvjax.engine", "kvjax.connector", "kvjax.serve", "kvjax.store", "kvjax.testing", "jax", "flax",
                 "tensorstore", "numpy"},
    # The engine reads no session rule: a session turn's merge mode arrives in its request
    # options (`kvjax.sessions.TurnPlan.request_options`), the salt carries no meaning.
    # The store sits behind the client: the engine hands it plain ids (the plan's encoding, a
    # request's tokens), never a storage object, a codec chooser or a key scheme.
    "engine": {"kvjax.entrypoints", "kvjax.serve", "kvjax.sessions", "kvjax.storage",
               "kvjax.testing", "tensorstore"},
    # The entry points (`LLM`, the server's builder) build an engine from the configuration tree;
    # the front ends (serve) and the tests sit above them.
    "entrypoints": {"kvjax.serve", "kvjax.testing"},
    # The configuration tree (every engine option declared once) sits below the engine and the
    # server: it reads the lower rooms' defaults and config records, never an engine or a front end.
    "config": {"kvjax.engine", "kvjax.connector", "kvjax.serve", "kvjax.store", "kvjax.testing"},
    # The KV connector sits below the engine: it never sees the engine, the models or a front end,
    # and calls no device library (device work belongs to the runner: the connector is handed its
    # `DeviceSeam`).
    "connector": {"kvjax.engine", "kvjax.models", "kvjax.serve", "kvjax.testing", "kvjax.store",
                  "kvjax.sessions", "kvjax.kernels",
                  "jax", "flax", "tensorstore"},
    "serve": {"kvjax.testing", "jax", "flax", "tensorstore"},
    # The operator CLI works on stores through the storage room, never through an engine.
    "store": {"kvjax.models", "kvjax.kernels", "kvjax.scheduler", "kvjax.engine", "kvjax.serve",
              "kvjax.sessions", "kvjax.testing", "jax", "flax"},
}

# The entry points (`LLM`, the server's builder) sit above every room but the front ends and the
# tests: no room below them imports them.
for _room in ("kernels", "scheduler", "storage", "models", "sessions", "config", "connector",
              "store"):
  FORBIDDEN[_room] = FORBIDDEN[_room] | {"kvjax.entrypoints"}

# Bottom-floor modules -> the only kvjax modules they may import, and the libraries they must not.
BOTTOM_FLOORS = {"_typing.py": set(), "_paths.py": set(), "codecs.py": {"kvjax._typing"},
                 "block_hash.py": {"kvjax._typing"}, "merge_mode.py": set()}
BOTTOM_FORBIDDEN = {"jax", "flax", "tensorstore", "numpy", "zstandard", "pcodec"}

# Room -> the only kvjax modules it may import (besides itself): serve sees the entry points,
# the engine, the configuration tree, the sessions and the request types, nothing below them;
# sessions see nothing but themselves and the merge modes.
ALLOWED_KVJAX = {
    "serve": {"kvjax.serve", "kvjax.entrypoints", "kvjax.engine", "kvjax.config",
              "kvjax.sessions",
              "kvjax.scheduler.request", "kvjax._typing", "kvjax.codecs", "kvjax.merge_mode"},
    # A session turn names its merge mode in its request options (`TurnPlan.request_options`).
    "sessions": {"kvjax.sessions", "kvjax.merge_mode"},
    "store": {"kvjax.store", "kvjax.storage", "kvjax.codecs", "kvjax._typing", "kvjax._paths"},
}


# Storage floors, bottom first: a storage module imports storage modules of lower floors only
# (no upward arrow, hence no cycle), and every storage module has its floor. The placement policy
# (`eviction`: the policy classes and the one leaf-first victim function) and the planner
# (`placement`) sit below every mover: the real tiers (`host_tier`, `tier_mover`, `tiers`) and
# the simulator both build on them. The chunk store's parts (object names, run-time plumbing,
# object reads, S3 publish mode, maintenance) sit below the store core (`chunk_store`), and the
# tier interface, the tiers' books (`tier_ledger`) and the mover below `tiers`.
STORAGE_FLOORS = (
    ("types", "checksum", "keys", "link", "store_config", "eviction"),
    ("specs", "rans", "placement", "store_runtime", "object_io"),
    ("entropy", "store_layout"),
    ("codecs", "s3_conditional"),
    ("host_tier", "store_admin"),
    ("chunk_store", "tier_api"),
    ("tier_ledger",),
    ("tier_mover",),
    ("tiers",),
)
# Scheduler floors, bottom first, as the storage ones: the scheduler (the owner of request
# state) sits on top; its policies (prefill order and short first-token steps, transfers, the
# paged layout's device prefix), CakeMerge's state records, forecasts and compute share, the
# configuration and the store side of its requests (`prefix_loads`) sit below it; none imports it.
SCHEDULER_FLOORS = (
    ("cost_model", "level_policy", "request", "output", "block_pool", "cake_share",
     "layer_split"),
    ("cake_state", "kv_cache_manager", "prefill_policy", "forks"),
    ("cake_forecast", "device_prefix", "config"),
    ("cake",),
    ("transfer_policy", "cake_joint"),
    ("prefix_loads",),
    ("scheduler",),
)
# Sessions floors, bottom first: the records (`types`) over the cut rule (`truncation`); the
# extension rule (`prompt`) and the files (`persistence`) over them; the registry; the one
# session-turn flow (`turn`) on top.
SESSIONS_FLOORS = (
    ("truncation",),
    ("types",),
    ("prompt", "persistence"),
    ("registry",),
    ("turn",),
)
# Floors of some modules of a room whose other modules have none (yet), bottom first: a listed
# module imports no listed module of its own floor or above. The KV codec: its payload records
# and argument checks, the jnp references, then the Pallas kernels and their wrappers. The
# engine's parts: its output records and the load side of execution, the save side, then the
# engine that owns them (neither part sees it).
PART_FLOORS = {
    "kernels": (("kv_payloads",), ("kv_codec_ref",), ("kv_codec",)),
    "engine": (("outputs", "kv_loads"), ("kv_saves",), ("engine",)),
}
# The policy modules read plain records: no scheduler state module above them.
SCHEDULER_POLICIES = {
    "prefill_policy": {"kvjax._typing", "kvjax.scheduler.request"},
    "cake_forecast": {"kvjax.scheduler.cake_state", "kvjax.scheduler.cost_model"},
    "cake_share": set(),
    "transfer_policy": {"kvjax.scheduler.cake", "kvjax.scheduler.cake_state",
                        "kvjax.scheduler.output"},
}

# Connector floors, bottom first, as the storage ones: plain records, the device seam's protocol
# and the event loop, then the parts, each owning its state (keys and lookups, the host -> device
# link; the saver, the look-ahead and the open requests; the loader, which asks the saver and the
# prefetcher through narrow calls), and the client, a front that builds them, on top.
CONNECTOR_FLOORS = (
    ("records", "device", "loop"),
    ("lookup", "transfer"),
    ("prefetch", "saver", "request_keys"),
    ("loader",),
    ("client",),
)
# Device work belongs to the runner: no connector module calls jax or the kernels; the runner
# hands the client its device seam (`kvjax.connector.device.DeviceSeam`).
CONNECTOR_DEVICE_MODULES = {"jax", "kvjax.kernels"}

# The paged runner's modules, bottom first: the interface and its records (`runner_api`, with
# the sizes both runners derive) and the connector's device seam (`device_seam`), the step's
# host inputs and the codec programs, the layer-wise step, the runner core that owns the pool,
# and the pool's sizing from device memory (it builds runners) on top. The fake runner builds on
# the interface only.
RUNNER_FLOORS = (
    ("runner_api", "device_seam"),
    ("step_inputs", "codec_programs"),
    ("layerwise_runner",),
    ("paged_runner",),
    ("pool_memory",),
)

# The policy and the planner are pure Python: no array, storage or I/O library.
PURE_STORAGE = {"eviction": {"kvjax._typing", "kvjax.storage.tiering.eviction"},
                "placement": {"kvjax.storage.tiering.eviction"}}
PURE_FORBIDDEN = {"jax", "flax", "tensorstore", "numpy", "zstandard", "pcodec", "asyncio"}


# The two largest rooms are split into sub-rooms (docs/architecture.md): a sub-room
# imports only itself and the sub-rooms listed for it; every module of the room lives in
# one.
SUB_ROOMS = {
    "models": {"nn": set(), "loading": {"nn"}, "runner": {"nn"}},
    "storage": {"format": set(), "backends": {"format"}, "tiering": {"format", "backends"}},
}


def room_module(room, stem):
  """The path of module `stem` of `room`, in whichever sub-room it lives."""
  paths = list((PKG / room).rglob(f"{stem}.py"))
  if len(paths) != 1:
    raise AssertionError(f"kvjax/{room}: {len(paths)} modules named {stem}")
  return paths[0]


def kvjax_modules():
  """Module name -> path, for every module of the package."""
  out = {}
  for path in PKG.rglob("*.py"):
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
  return out


def top_level_kvjax_imports(path, modules):
  """The kvjax modules `path` imports at module level (`from kvjax.a import b` counts as
  kvjax.a.b when that is a module, else kvjax.a)."""
  out = set()
  for node in ast.parse(path.read_text(), filename=str(path)).body:
    if isinstance(node, ast.Import):
      out |= {a.name for a in node.names if a.name in modules}
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
      for a in node.names:
        full = f"{node.module}.{a.name}"
        if full in modules:
          out.add(full)
        elif node.module in modules:
          out.add(node.module)
  return out


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

  def test_storage_modules_import_only_lower_floors(self):
    floor = {m: i for i, ms in enumerate(STORAGE_FLOORS) for m in ms}
    modules = kvjax_modules()
    names = sorted(p.stem for p in (PKG / "storage").rglob("*.py") if p.stem != "__init__")
    self.assertEqual(sorted(floor), names)  # a new storage module needs its floor here
    violations = []
    for name in names:
      path = room_module("storage", name)
      for mod in top_level_kvjax_imports(path, modules) | set(imported_modules(path)):
        dep = mod.split(".")[-1] if mod.startswith("kvjax.storage.") else None
        if dep in floor and floor[dep] >= floor[name]:
          violations.append(f"{room_module('storage', name).relative_to(PKG.parent)} imports {mod}")
    self.assertEqual(violations, [])

  def test_scheduler_modules_import_only_lower_floors(self):
    floor = {m: i for i, ms in enumerate(SCHEDULER_FLOORS) for m in ms}
    modules = kvjax_modules()
    names = sorted(p.stem for p in (PKG / "scheduler").glob("*.py") if p.stem != "__init__")
    self.assertEqual(sorted(floor), names)  # a new scheduler module needs its floor here
    violations = []
    for name in names:
      path = PKG / "scheduler" / f"{name}.py"
      for mod in top_level_kvjax_imports(path, modules) | set(imported_modules(path)):
        dep = mod.split(".")[2] if mod.startswith("kvjax.scheduler.") else None
        if dep in floor and floor[dep] >= floor[name]:
          violations.append(f"kvjax/scheduler/{name}.py imports {mod}")
    self.assertEqual(violations, [])

  def test_sessions_modules_import_only_lower_floors(self):
    floor = {m: i for i, ms in enumerate(SESSIONS_FLOORS) for m in ms}
    modules = kvjax_modules()
    names = sorted(p.stem for p in (PKG / "sessions").glob("*.py") if p.stem != "__init__")
    self.assertEqual(sorted(floor), names)  # a new sessions module needs its floor here
    violations = []
    for name in names:
      path = PKG / "sessions" / f"{name}.py"
      for mod in top_level_kvjax_imports(path, modules) | set(imported_modules(path)):
        dep = mod.split(".")[2] if mod.startswith("kvjax.sessions.") else None
        if mod == "kvjax.sessions" or (dep in floor and floor[dep] >= floor[name]):
          violations.append(f"kvjax/sessions/{name}.py imports {mod}")
    self.assertEqual(violations, [])

  def test_part_floors_import_only_lower_floors(self):
    modules = kvjax_modules()
    violations = []
    for room, floors in PART_FLOORS.items():
      floor = {m: i for i, ms in enumerate(floors) for m in ms}
      for name in floor:
        path = PKG / room / f"{name}.py"
        self.assertTrue(path.is_file(), path)
        for mod in top_level_kvjax_imports(path, modules) | set(imported_modules(path)):
          dep = mod.split(".")[2] if mod.startswith(f"kvjax.{room}.") else None
          if dep in floor and floor[dep] >= floor[name]:
            violations.append(f"kvjax/{room}/{name}.py imports {mod}")
    self.assertEqual(violations, [])

  def test_connector_modules_import_only_lower_floors(self):
    floor = {m: i for i, ms in enumerate(CONNECTOR_FLOORS) for m in ms}
    modules = kvjax_modules()
    names = sorted(p.stem for p in (PKG / "connector").glob("*.py") if p.stem != "__init__")
    self.assertEqual(sorted(floor), names)  # a new connector module needs its floor here
    violations = []
    for name in names:
      path = PKG / "connector" / f"{name}.py"
      for mod in top_level_kvjax_imports(path, modules) | set(imported_modules(path)):
        dep = mod.split(".")[2] if mod.startswith("kvjax.connector.") else None
        if dep in floor and floor[dep] >= floor[name]:
          violations.append(f"kvjax/connector/{name}.py imports {mod}")
    self.assertEqual(violations, [])

  def test_runner_modules_import_only_lower_floors(self):
    floor = {m: i for i, ms in enumerate(RUNNER_FLOORS) for m in ms}
    modules = kvjax_modules()
    violations = []
    for name in floor:
      path = room_module("models", name)
      for mod in top_level_kvjax_imports(path, modules) | set(imported_modules(path)):
        dep = mod.split(".")[-1] if mod.startswith("kvjax.models.") else None
        if dep in floor and floor[dep] >= floor[name]:
          violations.append(f"{room_module('models', name).relative_to(PKG.parent)} imports {mod}")
    fake = PKG / "testing" / "fake_runner.py"
    for mod in imported_modules(fake):
      if mod.startswith("kvjax.models.") and mod.split(".")[-1] in floor and (
          mod != "kvjax.models.runner.runner_api"):
        violations.append(f"kvjax/testing/fake_runner.py imports {mod}")
    self.assertEqual(violations, [])

  def test_no_connector_module_touches_the_device(self):
    violations = []
    for path in sorted((PKG / "connector").glob("*.py")):
      for mod in imported_modules(path):
        if any(mod == f or mod.startswith(f + ".") for f in CONNECTOR_DEVICE_MODULES):
          violations.append(f"{path.relative_to(PKG.parent)} imports {mod}")
    self.assertEqual(violations, [])

  def test_scheduler_policies_import_only_plain_records(self):
    violations = []
    for name, allowed in SCHEDULER_POLICIES.items():
      for mod in imported_modules(PKG / "scheduler" / f"{name}.py"):
        top = mod.split(".")[0]
        if (top == "kvjax" and mod not in allowed) or top in PURE_FORBIDDEN:
          violations.append(f"kvjax/scheduler/{name}.py imports {mod}")
    self.assertEqual(violations, [])

  def test_the_policy_and_the_planner_are_pure(self):
    violations = []
    for name, allowed in PURE_STORAGE.items():
      for mod in imported_modules(room_module("storage", name)):
        top = mod.split(".")[0]
        if (top == "kvjax" and mod not in allowed) or top in PURE_FORBIDDEN:
          violations.append(f"{room_module('storage', name).relative_to(PKG.parent)} imports {mod}")
    self.assertEqual(violations, [])

  def test_the_simulator_and_the_real_tiers_share_one_policy_registry(self):
    # session_sim replays the planner with the policy classes the real tiers build
    # (`eviction.make_policy`); neither keeps a registry of its own.
    sim = set(imported_modules(PKG / "testing" / "session_sim.py"))
    self.assertTrue({"kvjax.storage.tiering.eviction", "kvjax.storage.tiering.placement"} <= sim, sim)
    for path in ("storage/tiering/tiers.py", "storage/tiering/placement.py", "testing/session_sim.py"):
      self.assertIn("make_policy", (PKG / path).read_text(), path)
      self.assertNotIn("POLICIES: dict", (PKG / path).read_text(), path)

  def test_no_import_cycle(self):
    modules = kvjax_modules()
    graph = {m: top_level_kvjax_imports(p, modules) - {m} for m, p in modules.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(m, path):
      state[m] = 1
      for d in sorted(graph[m]):
        if state.get(d) == 1:
          cycles.append(" -> ".join(path[path.index(d):] + [d]))
        elif d not in state:
          visit(d, path + [d])
      state[m] = 2

    for m in sorted(graph):
      if m not in state:
        visit(m, [m])
    self.assertEqual(cycles, [])

  def test_the_codec_rooms_read_the_registry(self):
    # Kernels (the math) and storage (the byte format) take codec ids, levels and the chunk-size
    # rule from kvjax.codecs, so they cannot disagree.
    for path in ("kernels/kv_codec.py", "storage/format/codecs.py"):
      self.assertIn("kvjax.codecs", set(imported_modules(PKG / path)), path)

  def test_sub_rooms_import_only_lower_sub_rooms(self):
    violations = []
    for room, subs in SUB_ROOMS.items():
      self.assertEqual([p.name for p in (PKG / room).glob("*.py")], ["__init__.py"], room)
      self.assertEqual(sorted(p.name for p in (PKG / room).iterdir()
                              if (p / "__init__.py").is_file()), sorted(subs), room)
      for sub, allowed in subs.items():
        for path in sorted((PKG / room / sub).rglob("*.py")):
          for mod in imported_modules(path):
            other = mod.split(".")[2] if mod.startswith(f"kvjax.{room}.") else None
            if other in subs and other != sub and other not in allowed:
              violations.append(f"{path.relative_to(PKG.parent)} imports {mod}")
    self.assertEqual(violations, [])

  def test_rooms_exist(self):
    for room in ("kernels", "scheduler", "models", "engine", "connector", "storage", "serve",
                 "store", "sessions", "config", "entrypoints"):
      self.assertTrue((PKG / room / "__init__.py").is_file(), room)
    for name in BOTTOM_FLOORS:
      self.assertTrue((PKG / name).is_file(), name)


if __name__ == "__main__":
  absltest.main()
