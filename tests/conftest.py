"""pytest hooks shared by all kvjax tests."""

from absl import flags


def pytest_configure(config):
  del config  # Unused.
  # absltest.main() normally parses flags; under pytest nobody does, and reading a flag would fail.
  flags.FLAGS.mark_as_parsed()
