"""`n` > 1, penalties and logit_bias through the official `openai` client on the real tiny model
(jit'd programs, the pool's block copy): the same tests as
tests/unit/serve/n_choices_unit_test.py with the server and the offline reference over
`LLM("tiny")` instead of the fake runner."""

import pytest
from absl.testing import absltest

from kvjax.testing.engines import real_llm
from tests.unit.serve import n_choices_unit_test as unit


@pytest.mark.slow  # the assertions run on the fake runner in the default suite
class NChoicesTest(unit.NChoicesUnitTest):

  @classmethod
  def tiny_llm(cls, **kw):
    return real_llm("tiny", cache_dir="", chunk_sizes=(16, 32, 64), max_num_seqs=4,
                    kv_store="memory://", kv_chunk_size=16, **kw)


if __name__ == "__main__":
  absltest.main()
