"""The configuration tree (`kvjax.config`): each option declared once, with its text, its flag
and its `LLM` keyword of the same name; the server's flags round-trip to the same options."""

import dataclasses
import os
from unittest import mock

from absl import flags
from absl.testing import absltest

from kvjax import config
from kvjax.config import DEFAULT_MAX_NUM_SEQS, EngineOptions
from kvjax.serve import __main__ as serve_main
from kvjax.serve.server import ServerConfig, server_engine_options
from kvjax.testing import engines


def server_flags(*argv: str) -> flags.FlagValues:
  """The server's flags (`define_flags`) in a `FlagValues` of their own, parsed from `argv` (a
  test process may hold other absl programs' flags of the same names)."""
  flag_values = flags.FlagValues()
  serve_main.define_flags(flag_values)
  flag_values(["kvjax.serve", *argv])
  return flag_values


class OptionTreeTest(absltest.TestCase):

  def test_every_field_has_text_a_flag_and_an_llm_keyword(self):
    server_flag_values = server_flags()
    names = [f.name for _, f in config.all_option_fields()]
    self.assertLen(set(names), len(names))  # one declaration per option
    server_own = {f.name for f in dataclasses.fields(ServerConfig)}
    self.assertEqual(set(names) & server_own, set())
    for _, field in config.all_option_fields():
      spec = config.spec(field)
      with self.subTest(spec.name):
        self.assertTrue(spec.doc and spec.help)
        self.assertIn(spec.flag, config.FLAG_KINDS)
        flag = server_flag_values[spec.name]  # the server's flag of the same name
        self.assertEqual(flag.help.split(">: ", 1)[-1] if spec.flag == "enum" else flag.help,
                         spec.help)
        self.assertEqual(flag.default, config.flag_default(field))
        default = config.field_default(field)
        # The `LLM` keyword of the same name (`LLM(**flat)` -> `EngineOptions.from_flat`).
        self.assertEqual(EngineOptions.from_flat(**{spec.name: default}).flat()[spec.name],
                         default)
    for field in config.option_fields(ServerConfig):
      self.assertEndsWith(server_flag_values[field.name].help, config.spec(field).help)

  def test_flat_round_trip_and_sections(self):
    opts = EngineOptions.from_flat(model="tiny", kv_store="memory://", kv_codec="int8",
                                   max_num_seqs=8, session_ttl_s=None)
    self.assertEqual((opts.model.model, opts.kv.kv_codec, opts.scheduler.max_num_seqs,
                      opts.sessions.session_ttl_s), ("tiny", "int8", 8, None))
    self.assertEqual(EngineOptions.from_flat(**opts.flat()), opts)
    self.assertEqual(opts.replace(max_num_seqs=2).scheduler.max_num_seqs, 2)
    self.assertEqual(opts.codec_levels, (0,))  # int8's one level
    self.assertTrue(opts.consistent)  # lossy codec, 256 a compiled size within the budget
    with self.assertRaisesRegex(TypeError, "'kv_cache_layout'"):
      EngineOptions.from_flat(kv_cache_layout="paged")

  def test_checks_name_the_option(self):
    for flat, message in (
        (dict(max_num_seqs=0), "max_num_seqs=0 must be a positive int"),
        (dict(chunk_sizes=(32, 16)), "must be ascending and distinct"),
        (dict(kv_codec="zip"), "kv_codec='zip'; use one of"),
        (dict(kv_store="memory://", kv_chunk_size=24), "kv_chunk_size=24 must be a whole "
         "number of blocks"),
        (dict(kv_merge_mode="both"), "kv_merge_mode='both'"),
        (dict(dtype="f16"), "dtype 'f16' is not one of"),
        (dict(session_rerotate=True, session_truncation="drop_oldest_turns"),
         "needs a kv_store"),
        (dict(kv_store="memory://", kv_codec="int8", kv_chunk_size=48,
              kv_codec_consistent=True), "kv_codec_consistent=True needs kv_chunk_size=48"),
        (dict(kv_store="memory://", kv_placement="write_around"), "kv_placement")):
      with self.subTest(str(flat)), self.assertRaisesRegex(ValueError, message):
        EngineOptions.from_flat(**flat)

  def test_llm_takes_the_tree_or_flat_keywords(self):
    opts = EngineOptions.from_flat(model="tiny", max_num_seqs=2, compile_on_init=False,
                                   cache_dir="")
    llm = engines.fake_llm(options=opts, max_num_seqs=3)  # a flat keyword overrides the tree
    try:
      self.assertEqual(llm.options, opts.replace(max_num_seqs=3))
      self.assertEqual(llm.engine.runner.config.num_slots, 3)
    finally:
      llm.close()
    with self.assertRaises(TypeError):
      engines.fake_llm(compile_on_init=False, kv_cache_layout="paged")


class ServerFlagsTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    env = mock.patch.dict(os.environ)
    env.start()
    self.addCleanup(env.stop)
    os.environ.pop("KVJAX_API_KEY", None)

  def test_default_flags_are_the_default_server_config(self):
    config = serve_main.config_from_flags(server_flags())
    self.assertEqual(config, ServerConfig())
    self.assertEqual(config.engine, server_engine_options())
    self.assertEqual(config.engine.scheduler.max_num_seqs, DEFAULT_MAX_NUM_SEQS)
    self.assertEqual(config.engine.kv.kv_store, "default")
    self.assertEqual(config.engine.replace(kv_store=None), EngineOptions())
    self.assertEqual(config.llm_options(), ServerConfig.from_flat().llm_options())

  def test_flag_values_reach_the_engine_options(self):
    config = serve_main.config_from_flags(server_flags(
        "--model=tiny", "--kv_store=memory://", "--kv_codec=cachegen", "--max_num_seqs=8",
        "--kv_codec_consistent=false", "--chunk_sizes=16,32,64,128,256", "--session_ttl_s=-1",
        "--max_waiting_requests=-1", "--allowed_origins=https://a.example",
        "--kv_codec_levels=0,1"))
    self.assertEqual(config, ServerConfig.from_flat(
        model="tiny", kv_store="memory://", kv_codec="cachegen", max_num_seqs=8,
        kv_codec_consistent=False, chunk_sizes=(16, 32, 64, 128, 256), session_ttl_s=None,
        max_waiting_requests=None, allowed_origins=("https://a.example",),
        kv_codec_levels=(0, 1)))
    self.assertIsNone(
        serve_main.config_from_flags(server_flags("--kv_store=none")).engine.kv.kv_store)


if __name__ == "__main__":
  absltest.main()
