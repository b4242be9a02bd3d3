"""Chat sessions through the server on the real tiny model: the same tests as
tests/unit/serve/sessions_serve_unit_test.py (exact-id extension visible in usage and device
prefix hits, 409 on a busy session, salts, aborted and failed turns, metrics), with the server
over `LLM("tiny")` (byte tokenizer, paged, device prefix cache) instead of the fake runner."""

import pytest
from absl.testing import absltest

from kvjax.testing.engines import real_llm
from tests.unit.serve import sessions_serve_unit_test as unit


@pytest.mark.slow  # the assertions run on the fake runner in the default suite
class SessionsServeTest(unit.SessionsServeUnitTest):

  @classmethod
  def make_llm(cls):
    return real_llm("tiny", cache_dir="", chunk_sizes=(16, 32, 64), max_num_seqs=4)


class SessionsWithApiKeyTest(unit.SessionsWithApiKeyUnitTest):
  """DELETE /v1/sessions needs the API key like every other route (the real model)."""

  @classmethod
  def make_llm(cls):
    return real_llm("tiny", cache_dir="", chunk_sizes=(16,), max_num_seqs=1)


if __name__ == "__main__":
  absltest.main()
