"""`LLM("org/tiny")` and `python -m kvjax.serve --model=org/...` the way a user runs them
offline: `HF_HOME` pointing at a hub cache laid out in a temp dir (`kvjax/testing/hub_cache.py`)
and `HF_HUB_OFFLINE=1`, in a fresh process (huggingface_hub reads both when it is imported). The
hub id's answer equals the answer of the same snapshot loaded as a local folder in this
process; an id not in the cache is one error line from the server."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
from absl.testing import absltest

from kvjax import SamplingParams
from kvjax.testing import hub_cache
from kvjax.testing.engines import real_llm

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
COMMIT = "0123456789abcdef0123456789abcdef01234567"
OPTIONS = dict(cache_dir="", max_num_seqs=1, chunk_sizes=(16, 32), compile_on_init=False)
MESSAGES = [{"role": "user", "content": "Name a planet."}]

SCRIPT = textwrap.dedent("""
    import json, sys
    from kvjax import LLM, SamplingParams
    llm = LLM("org/tiny", startup_progress=None, **json.loads(sys.argv[1]))
    out = llm.chat(json.loads(sys.argv[2]), SamplingParams(max_tokens=6, temperature=0))[0]
    print(json.dumps({"name": llm.model_name, "token_ids": list(out.token_ids),
                      "prompt_token_ids": list(out.prompt_token_ids)}))
    try:
      LLM("org/absent", startup_progress=None, **json.loads(sys.argv[1]))
    except FileNotFoundError as e:
      print(json.dumps({"missing": str(e)}))
""")


@pytest.mark.slow  # a fresh process importing jax and compiling the tiny model: about 30 s
class OfflineHubIdTest(absltest.TestCase):

  def test_llm_from_a_hub_id_offline_equals_the_local_folder(self):
    home = self.create_tempdir("hf_home").full_path
    folder = hub_cache.add_snapshot(os.path.join(home, "hub"), "org/tiny", COMMIT)
    env = {**os.environ, "HF_HOME": home, "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])}
    env.pop("HF_HUB_CACHE", None)
    proc = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(OPTIONS),
                           json.dumps(MESSAGES)], env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    self.assertLen(lines, 2, proc.stdout)
    got, missing = lines
    self.assertEqual(got["name"], "org/tiny")
    llm = real_llm(folder, **OPTIONS)
    try:
      want = llm.chat(MESSAGES, SamplingParams(max_tokens=6, temperature=0))[0]
    finally:
      llm.close()
    self.assertEqual(got["prompt_token_ids"], list(want.prompt_token_ids))
    self.assertEqual(got["token_ids"], list(want.token_ids))
    self.assertRegex(missing["missing"], "org/absent is not in the Hugging Face cache "
                     f"{os.path.join(home, 'hub')} .*HF_HUB_OFFLINE=1")

  def test_server_with_an_uncached_hub_id_says_so_in_one_line(self):
    home = self.create_tempdir("hf_home").full_path
    env = {**os.environ, "HF_HOME": home, "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])}
    env.pop("HF_HUB_CACHE", None)
    proc = subprocess.run(
        [sys.executable, "-m", "kvjax.serve", "--model=org/absent", "--port=0", "--cache_dir=",
         "--kv_store=memory://", "--max_num_seqs=1", "--chunk_sizes=16,32"],
        env=env, capture_output=True, text=True, timeout=300, check=False)
    self.assertNotEqual(proc.returncode, 0)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    self.assertLen(errors, 1, proc.stderr)
    self.assertRegex(errors[0], "^error: loading 'org/absent' failed: org/absent is not in the "
                     "Hugging Face cache .* check the id")
    self.assertNotIn("Traceback", proc.stderr)


if __name__ == "__main__":
  absltest.main()
