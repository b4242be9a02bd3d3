"""Hub ids (`kvjax/models/loading/hub.py`) without a network: a hub cache laid out in a temp dir
(`kvjax/testing/hub_cache.py`) read by huggingface_hub's own `snapshot_download` offline, and
the hub's errors raised by a stub download, each mapped to one line that says what to do."""

import fnmatch
import functools
import json
import os
import shutil
import types

import numpy as np
from absl import flags
from absl.testing import absltest
from absl.testing import parameterized
from huggingface_hub import errors, snapshot_download

from kvjax.config import EngineOptions
from kvjax.models.loading import hub, registry
from kvjax.serve import ServerConfig
from kvjax.serve import __main__ as serve_main
from kvjax.testing import hub_cache

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER_COMMIT = "fedcba9876543210fedcba9876543210fedcba98"


class Recorder:
  """A `hub.Download` over the temp cache (offline), recording each call's patterns."""

  def __init__(self, cache: str):
    self.patterns: list[tuple[str, ...]] = []
    self._download = functools.partial(snapshot_download, cache_dir=cache, local_files_only=True)

  def __call__(self, repo_id, *, revision, allow_patterns):
    self.patterns.append(tuple(allow_patterns))
    return self._download(repo_id, revision=revision, allow_patterns=allow_patterns)


class OfflineCacheTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.cache = self.create_tempdir("hub").full_path
    self.folder = hub_cache.add_snapshot(self.cache, "org/tiny", COMMIT)
    self.download = Recorder(self.cache)

  def test_hub_id_loads_from_the_cache_as_the_folder_would(self):
    got = registry.load_model("org/tiny", download=self.download)
    want = registry.load_model(self.folder)
    self.assertEqual(got.name, "org/tiny")
    self.assertEqual(got.fingerprint, want.fingerprint)
    cfg = hub_cache.tiny_chat_config()
    self.assertEqual(got.config.vocab_size, cfg.vocab_size)
    for k, v in registry.tiny_params(cfg).items():
      np.testing.assert_array_equal(got.params[k], v, err_msg=k)
    self.assertEqual(got.tokenizer.encode("hi"), [ord("h"), ord("i")])
    self.assertEqual(got.tokenizer.eos_id, 257)
    # The config first (the architecture check), then the model's files, nothing else.
    self.assertEqual(self.download.patterns, [hub.CONFIG_FILES, hub.MODEL_FILES])
    self.assertEqual(registry.load_config("org/tiny", download=self.download), want.config)
    self.assertEqual(self.download.patterns[2:], [hub.CONFIG_FILES])

  def test_revision_picks_the_tag_s_commit(self):
    other = hub_cache.add_snapshot(self.cache, "org/tiny", OTHER_COMMIT, ref="v1")
    self.assertEqual(hub.download_model("org/tiny", download=self.download), self.folder)
    self.assertEqual(hub.download_model("org/tiny", revision="v1", download=self.download), other)
    self.assertEqual(hub.download_model("org/tiny", revision=OTHER_COMMIT,
                                        download=self.download), other)
    with self.assertRaisesRegex(hub.HubModelNotFoundError, "org/tiny at revision 'v2' is not in"):
      registry.load_model("org/tiny", revision="v2", download=self.download)

  def test_a_template_saved_as_chat_template_jinja_is_fetched(self):
    # transformers 5 saves the chat template beside tokenizer_config.json, not inside it.
    config_path = os.path.join(self.folder, "tokenizer_config.json")
    with open(config_path) as f:
      tok_config = json.load(f)
    with open(os.path.join(self.folder, "chat_template.jinja"), "w") as f:
      f.write(tok_config.pop("chat_template"))
    os.remove(config_path)  # a symlink into the blobs: write a file of its own
    with open(config_path, "w") as f:
      json.dump(tok_config, f)
    fetched = self.create_tempdir("fetched").full_path

    def download(repo_id, *, revision, allow_patterns):  # a hub: only the files asked for
      del repo_id, revision
      for name in os.listdir(self.folder):
        if any(fnmatch.fnmatch(name, p) for p in allow_patterns):
          shutil.copyfile(os.path.join(self.folder, name), os.path.join(fetched, name))
      return fetched

    got = registry.load_model("org/tiny", download=download)
    want = registry.load_model(self.folder)
    chat = [{"role": "user", "content": "hi"}]
    self.assertEqual(got.tokenizer.encode_chat(chat), want.tokenizer.encode_chat(chat))

  def test_a_missing_id_says_so(self):
    with self.assertRaisesRegex(FileNotFoundError, "org/nothing is not in the Hugging Face cache")\
        as raised:
      registry.load_model("org/nothing", download=self.download)
    self.assertIsInstance(raised.exception, hub.HubModelNotFoundError)
    self.assertNotIn("\n", str(raised.exception))

  def test_unsupported_architecture_stops_before_the_weights(self):
    folder = hub_cache.add_snapshot(self.cache, "org/gpt2", OTHER_COMMIT,
                                    architectures=["GPT2LMHeadModel"])
    os.remove(os.path.join(folder, "model.safetensors"))  # never asked for: its absence is moot
    with self.assertRaisesRegex(ValueError, r"^org/gpt2 \(Hugging Face hub\): unsupported "
                                r"architectures \['GPT2LMHeadModel'\].*'LlamaForCausalLM'.*"
                                r"'Qwen3ForCausalLM'.*nothing else was downloaded"):
      registry.load_model("org/gpt2", download=self.download)  # named by its id, not its commit
    self.assertEqual(self.download.patterns, [hub.CONFIG_FILES])

  def test_a_snapshot_without_safetensors_says_so(self):
    os.remove(os.path.join(self.folder, "model.safetensors"))
    with self.assertRaisesRegex(hub.HubModelNotFoundError, r"no \*\.safetensors weights"):
      registry.load_model("org/tiny", download=self.download)

  def test_sharded_snapshot_loads(self):
    folder = hub_cache.add_snapshot(self.cache, "org/sharded", OTHER_COMMIT,
                                    max_shard_bytes=20_000)
    self.assertGreater(len([f for f in os.listdir(folder) if f.endswith(".safetensors")]), 1)
    got = registry.load_model("org/sharded", download=self.download)
    self.assertEqual(got.fingerprint, registry.load_model(self.folder).fingerprint)


def http_error(cls, status: int, message: str = "refused"):
  """One of huggingface_hub's HTTP errors with a response of `status` (a stand-in response:
  the attributes the error reads)."""
  response = types.SimpleNamespace(status_code=status, headers={}, request=None)
  return cls(message, response=response)


class ErrorMappingTest(parameterized.TestCase):

  def raising(self, error: Exception):
    def download(repo_id, *, revision, allow_patterns):
      del repo_id, revision, allow_patterns
      raise error
    return download

  @parameterized.named_parameters(
      ("gated", lambda: http_error(errors.GatedRepoError, 403), hub.GatedModelError,
       PermissionError, "org/m is a gated model: accept its licence on "
       r"https://huggingface.co/org/m and set HF_TOKEN"),
      ("unauthorized", lambda: http_error(errors.HfHubHTTPError, 401), hub.GatedModelError,
       PermissionError, r"refused access to org/m \(HTTP 401\).*set HF_TOKEN"),
      ("missing", lambda: http_error(errors.RepositoryNotFoundError, 404),
       hub.HubModelNotFoundError, FileNotFoundError,
       "model 'org/m' not found on the Hugging Face hub.*check the id"),
      ("no_revision", lambda: http_error(errors.RevisionNotFoundError, 404),
       hub.HubModelNotFoundError, FileNotFoundError,
       "org/m has no revision 'v9'.*--model_revision"),
      ("offline", lambda: errors.LocalEntryNotFoundError("no snapshot"),
       hub.HubModelNotFoundError, FileNotFoundError,
       "org/m at revision 'v9' is not in the Hugging Face cache.*cannot be reached"),
      ("server_error", lambda: http_error(errors.HfHubHTTPError, 503), hub.HubModelError,
       OSError, r"failed to serve org/m at revision 'v9' \(HTTP 503\): try again later"),
  )
  def test_hub_errors_become_one_line_saying_what_to_do(self, make, kind, builtin, message):
    for call in (hub.download_config, hub.download_model):
      with self.assertRaisesRegex(kind, message) as raised:
        call("org/m", revision="v9", download=self.raising(make()))
      self.assertIsInstance(raised.exception, builtin)
      self.assertNotIn("\n", str(raised.exception))

  def test_load_model_and_load_config_raise_them_too(self):
    download = self.raising(http_error(errors.GatedRepoError, 403))
    with self.assertRaises(hub.GatedModelError):
      registry.load_model("meta-llama/Llama-3.1-8B-Instruct", download=download)
    with self.assertRaises(hub.GatedModelError):
      registry.load_config("meta-llama/Llama-3.1-8B-Instruct", download=download)


class HubIdTest(absltest.TestCase):

  def test_what_reads_as_a_hub_id(self):
    for name in ("Qwen/Qwen2.5-7B-Instruct", "meta-llama/Llama-3.1-8B-Instruct", "a/b"):
      self.assertTrue(hub.is_hub_id(name), name)
    for name in ("tiny", "org/name/extra", "/abs/path", "org/x.gguf", "./local", "org/",
                 "-x/y"):
      self.assertFalse(hub.is_hub_id(name), name)
    folder = self.create_tempdir().full_path
    os.makedirs(os.path.join(folder, "org", "name"))
    old = os.getcwd()
    os.chdir(folder)
    try:  # a local folder of that name wins over the hub
      self.assertFalse(hub.is_hub_id("org/name"))
    finally:
      os.chdir(old)

  def test_a_revision_needs_a_hub_id(self):
    with self.assertRaisesRegex(ValueError, r"a model revision \('v1'\) needs a Hugging Face hub "
                                "id"):
      registry.load_model("tiny", revision="v1")

  def test_revision_option_and_flag(self):
    self.assertIsNone(EngineOptions.from_flat(model="org/m").model.model_revision)
    opts = EngineOptions.from_flat(model="org/m", model_revision="v1")
    self.assertEqual(opts.model.model_revision, "v1")
    with self.assertRaisesRegex(ValueError, "model_revision=' ' must be a branch"):
      EngineOptions.from_flat(model="org/m", model_revision=" ")
    flag_values = flags.FlagValues()
    serve_main.define_flags(flag_values)
    flag_values(["kvjax.serve", "--model=org/m", "--model_revision=v2"])
    config = serve_main.config_from_flags(flag_values)
    self.assertEqual(config.engine.model.model_revision, "v2")
    self.assertEqual(ServerConfig.from_flat(model="org/m", model_revision="v3")
                     .llm_options()["model_revision"], "v3")


if __name__ == "__main__":
  absltest.main()
