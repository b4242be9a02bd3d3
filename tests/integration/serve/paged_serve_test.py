"""The paged KV layout through the server on the real tiny model: the same tests as
tests/unit/serve/paged_serve_unit_test.py (device prefix hits in the `kvjax` response field and
`/metrics`, KV pool usage and preemptions) with the server over `LLM("tiny")` instead of the fake
runner."""

import pytest
from absl.testing import absltest

from kvjax.testing.engines import real_llm
from tests.unit.serve import paged_serve_unit_test as unit


def paged_llm(**kw):
  return real_llm("tiny", cache_dir="", chunk_sizes=(16, 32, 64), block_size=unit.B,
                  kv_cache_memory_bytes=unit.NUM_BLOCKS * unit.BLOCK_NBYTES, max_num_seqs=4,
                  **kw)


@pytest.mark.slow  # the assertions run on the fake runner in the default suite
class PagedServeTest(unit.PagedServeUnitTest):

  @classmethod
  def make_llm(cls):
    return paged_llm()


@pytest.mark.slow  # the assertions run on the fake runner in the default suite
class NoPrefixCachingServeTest(unit.NoPrefixCachingServeUnitTest):

  @classmethod
  def make_llm(cls):
    return paged_llm(enable_prefix_caching=False)


if __name__ == "__main__":
  absltest.main()
