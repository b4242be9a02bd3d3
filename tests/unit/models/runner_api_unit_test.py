"""The `Runner` protocol (`kvjax.models.runner.runner_api`): both runners implement every call, and the
engine's calls are the protocol's."""

import ast
import pathlib

import numpy as np
from absl.testing import absltest

from kvjax.models.runner import runner_api
from kvjax.models.runner.paged_runner import PagedModelRunner
from kvjax.models.runner.runner_api import PagedRunnerConfig, SeqChunk
from kvjax.testing.fake_runner import FakeRunner

ENGINE = pathlib.Path(runner_api.__file__).resolve().parents[2] / "engine" / "engine.py"


def protocol_attributes():
  """The protocol's plain attributes (annotated; instances set them)."""
  return set(runner_api.Runner.__annotations__)


def protocol_members():
  return sorted(protocol_attributes() | {n for n in dir(runner_api.Runner)
                                          if not n.startswith("_") and n not in dir(object)})


class RunnerApiUnitTest(absltest.TestCase):

  def test_the_fake_runner_is_a_runner(self):
    runner = FakeRunner(PagedRunnerConfig(num_blocks=8, chunk_sizes=(16, 32),
                                          max_num_batched_tokens=32))
    self.assertIsInstance(runner, runner_api.Runner)

  def test_the_paged_runner_defines_every_call(self):
    # Attributes set in __init__ (config, model_config, buckets, ...) are not on the class.
    missing = [n for n in protocol_members()
               if n not in protocol_attributes() and not hasattr(PagedModelRunner, n)]
    self.assertEqual(missing, [])

  def test_the_engine_calls_only_protocol_members_on_its_runner(self):
    tree = ast.parse(ENGINE.read_text())
    used = set()
    for node in ast.walk(tree):
      # self.runner.X and runner.X (the local alias `runner = self.runner`)
      if isinstance(node, ast.Attribute) and (
          isinstance(node.value, ast.Attribute) and node.value.attr == "runner"
          or isinstance(node.value, ast.Name) and node.value.id == "runner"):
        used.add(node.attr)
    self.assertEqual(sorted(used - set(protocol_members())), [])

  def test_fake_runner_bad_input(self):
    runner = FakeRunner(PagedRunnerConfig(num_blocks=8, chunk_sizes=(16, 32),
                                          max_num_batched_tokens=32))
    m = runner.model_config
    kv = np.zeros((m.n_layers, 2, 16, m.n_kv_heads, m.head_dim), np.float32)
    for call, message in (
        (lambda: runner.step([]), "at least one"),
        (lambda: runner.step([SeqChunk([1] * 33, 0, [0, 1, 2])]), "compiled sizes"),
        (lambda: runner.step([SeqChunk([1] * 20, 0, [0])]), "blocks of 16"),
        (lambda: runner.step([SeqChunk([300], 0, [0])]), "vocab|outside"),
        (lambda: runner.insert_chunk(kv[:1], [0], 0), "model wants"),
        (lambda: runner.insert_chunk(kv, [0], 8), "whole blocks"),
        (lambda: runner.insert_chunk(kv, [9], 0), "inside the pool"),
        (lambda: runner.read_pre_rope([0], 3, 4), "block-aligned"),
        (lambda: runner.encode_levels(kv, "kvtc", (0,), 0), "kvtc")):
      with self.assertRaisesRegex(ValueError, message):
        call()


if __name__ == "__main__":
  absltest.main()
