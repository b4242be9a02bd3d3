"""Bad input gets a 4xx OpenAI-style body; faults fail one request and never the server: the same
tests as tests/unit/serve/serve_errors_unit_test.py with the server over `LLM("tiny")` instead of
the fake runner."""

import pytest
from absl.testing import absltest

from kvjax.testing.engines import real_llm
from tests.unit.serve import serve_errors_unit_test as unit


@pytest.mark.slow  # the assertions run on the fake runner in the default suite
class ServeErrorsTest(unit.ServeErrorsUnitTest):

  @classmethod
  def make_llm(cls):
    return real_llm("tiny", cache_dir="", max_num_seqs=2, chunk_sizes=(16, 32, 64),
                    kv_store="memory://", kv_chunk_size=unit.CHUNK, kv_merge_mode="load_only",
                    enable_prefix_caching=False)


@pytest.mark.slow  # the assertions run on the fake runner in the default suite
class StartupTest(unit.StartupUnitTest):

  @classmethod
  def make_llm(cls):
    return real_llm("tiny", cache_dir="", max_num_seqs=1, chunk_sizes=(16,))


if __name__ == "__main__":
  absltest.main()
