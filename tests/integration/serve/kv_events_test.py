"""KV cache events through the server on the real tiny model: the same tests as
tests/unit/serve/kv_events_unit_test.py (vLLM's block hashes, clears, evictions, salted prompts,
replays, the routing gauges) with the server over `LLM("tiny")` instead of the fake runner."""

import pytest
from absl.testing import absltest

from kvjax.testing.engines import real_llm
from tests.unit.serve import kv_events_unit_test as unit


@pytest.mark.slow  # the assertions run on the fake runner in the default suite
class KVEventsServeTest(unit.KVEventsServeUnitTest):

  @classmethod
  def make_llm(cls, **options):
    return real_llm("tiny", cache_dir="", **options)


if __name__ == "__main__":
  absltest.main()
