"""pytest hooks shared by all kvjax tests.

Test engines come from one factory, `kvjax.testing.engines` (`real_llm`: `LLM` with
`compile_on_init=False`; `fake_llm`, `fake_engine`: the fake runner); nothing here changes a
default of kvjax."""

import atexit
import os
import shutil
import tempfile

import jax
from absl import flags

_JAX_CACHE_ENV = "KVJAX_TEST_JAX_CACHE_DIR"


def pytest_configure(config):
  del config  # Unused.
  # absltest.main() normally parses flags; under pytest nobody does, and reading a flag would fail.
  flags.FLAGS.mark_as_parsed()
  # pytest-xdist's workers (`-n 2`, pyproject's addopts) run one XLA thread each: two processes
  # each starting a pool as wide as the machine would oversubscribe the cores (and spin-wait).
  # Set before any test initializes the CPU backend; subprocesses (servers under test) inherit
  # it.
  if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["XLA_FLAGS"] = " ".join(filter(None, [
        os.environ.get("XLA_FLAGS"), "--xla_cpu_multi_thread_eigen=false"]))
  # One compilation cache for the whole run: the many engines the tests build compile the same
  # tiny programs, so every engine after the first loads them instead of recompiling. Tests that
  # pass cache_dir="" keep it (kvjax leaves a configured cache alone). The first process makes it
  # and removes it at exit; pytest-xdist's workers, started after this hook, inherit its path
  # (a worker that reads an entry another is still writing gets JAX's warning and compiles).
  if not jax.config.jax_compilation_cache_dir:
    path = os.environ.get(_JAX_CACHE_ENV)
    if not path:
      path = tempfile.mkdtemp(prefix="kvjax-test-jax-cache-")
      os.environ[_JAX_CACHE_ENV] = path
      atexit.register(shutil.rmtree, path, ignore_errors=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    # Processes the tests start (`python -m kvjax.serve --cache_dir=`, drivers) read JAX's
    # options from the environment: they share the cache too, so a server start after the first
    # loads the programs instead of compiling them (its log lines are the same).
    os.environ.update(JAX_COMPILATION_CACHE_DIR=path,
                      JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                      JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
