"""The server through the official `openai` client on the real tiny model: the same tests as
tests/unit/serve/openai_api_unit_test.py (memory store, port 0) with the server and the offline
reference over `LLM("tiny")` instead of the fake runner."""

import pytest
from absl.testing import absltest

from kvjax.testing.engines import real_llm
from tests.unit.serve import openai_api_unit_test as unit


@pytest.mark.slow  # the assertions run on the fake runner in the default suite
class OpenAIApiTest(unit.OpenAIApiUnitTest):

  @classmethod
  def tiny_llm(cls, **kw):
    return real_llm("tiny", cache_dir="", chunk_sizes=(16, 32, 64), **kw)


if __name__ == "__main__":
  absltest.main()
