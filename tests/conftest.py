"""pytest hooks shared by all kvjax tests."""

import atexit
import shutil
import tempfile

import jax
from absl import flags

from kvjax.engine.llm import LLM


def pytest_configure(config):
  del config  # Unused.
  # absltest.main() normally parses flags; under pytest nobody does, and reading a flag would fail.
  flags.FLAGS.mark_as_parsed()
  # One compilation cache for the whole session: the many engines the tests build compile the
  # same tiny programs, so every engine after the first loads them instead of recompiling. Tests
  # that pass cache_dir="" keep it (kvjax leaves a configured cache alone). Removed at exit.
  if not jax.config.jax_compilation_cache_dir:
    path = tempfile.mkdtemp(prefix="kvjax-test-jax-cache-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  # `LLM(compile_on_init=True)`, the serving default, compiles every program a request could run
  # (each chunk size, decode, insertion, the codec's encode) so no TTFT pays a compile. The suite
  # builds about a hundred LLMs, each running a few of those programs: here they compile what
  # they run (about a fifth of the suite's time). Outputs do not depend on it; the tests of the
  # warm-up itself pass compile_on_init=True or call `warmup()`.
  LLM.__init__.__kwdefaults__["compile_on_init"] = False

