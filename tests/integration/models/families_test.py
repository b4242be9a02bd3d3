"""The model families (LLaMA, Mistral, Qwen2, Qwen3) in the one Flax model against transformers.

Fixtures in tests/testdata/families/ come from scripts/make_family_fixtures.py: tiny random
checkpoints saved by transformers (bfloat16 weights, Qwen3's in three shards with an index), the
float32 logits and greedy tokens transformers computes from them, and chat-template renderings.
This test needs no torch. Each family exercises its own switch: LLaMA-3 rope scaling (llama), a
sliding window shorter than the positions (mistral), q/k/v biases and tied embeddings (qwen2),
the per-head q/k RMSNorm and a head_dim wider than d_model / heads (qwen3).
"""

import dataclasses
import json
import os
import pathlib
import shutil

import numpy as np
import pytest
from absl.testing import absltest, parameterized

from kvjax import SamplingParams
from kvjax.models.nn import config as config_lib
from kvjax.models.loading import safetensors_loader
from kvjax.models.loading.fingerprint import model_fingerprint
from kvjax.models.nn.llama import Llama
from kvjax.models.runner.paged_runner import PagedModelRunner
from kvjax.models.loading.registry import load_model
from kvjax.models.runner.runner_api import PagedRunnerConfig, SeqChunk
from kvjax.testing import oracle
from kvjax.testing.engines import real_llm

DATA = pathlib.Path(__file__).resolve().parents[2] / "testdata" / "families"
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
LOGIT_ATOL = 1e-3  # as tests/integration/models/smollm2_reference_test.py
# A greedy mismatch is accepted only where the reference's top-2 logits were this close, and
# nothing after it is compared.
NEAR_TIE = 2 * LOGIT_ATOL
CHUNK = 64


def folder(family: str) -> str:
  return str(DATA / family)


def references() -> dict:
  return json.loads((DATA / "references.json").read_text())


class FamiliesReferenceTest(parameterized.TestCase):

  def check_family(self, family, prompts, num_greedy):
    """Fixture prompts prefilled in chunks of 64 on the paged runner: the last logits against
    transformers', a first chunk's pre-RoPE keys against the oracle's, then up to `num_greedy`
    of the fixture's greedy steps decoded one token at a time; then a stored chunk inserted."""
    loaded = load_model(folder(family), cache_dir=None)
    ref = np.load(DATA / f"{family}_reference.npz")
    runner = PagedModelRunner(
        Llama.from_params(loaded.config, loaded.params),
        PagedRunnerConfig(num_blocks=16, block_size=16, max_num_seqs=1,
                          max_num_batched_tokens=CHUNK, max_seq_len=256, chunk_sizes=(16, CHUNK)))
    table = list(range(16))
    checked_keys = False
    for i in prompts:
      with self.subTest(prompt=i):
        ids = ref[f"prompt_ids_{i}"].tolist()
        runner.reset()
        for start in range(0, len(ids), CHUNK):
          out = runner.step([SeqChunk(ids[start:start + CHUNK], start, table)])
          if start == 0 and len(ids) > CHUNK and not checked_keys:
            # What the store saves: K after its bias and q/k norm, before RoPE.
            _, k_pre_LTKH, _ = oracle.oracle_forward(loaded.config, loaded.params, ids[:CHUNK])
            np.testing.assert_allclose(np.asarray(out.k_pre_rope_LTKH), k_pre_LTKH,
                                       atol=1e-4, rtol=0)
            checked_keys = True
        logits = np.asarray(out.logits_SV[0])
        np.testing.assert_allclose(logits, ref[f"last_logits_{i}"], atol=LOGIT_ATOL, rtol=0)
        want, gaps = ref[f"greedy_ids_{i}"].tolist()[:num_greedy], ref[f"greedy_gap_{i}"]
        for step, token_want in enumerate(want):
          token = int(np.argmax(logits))
          if token != token_want:
            self.assertLess(gaps[step], NEAR_TIE,
                            f"{family} prompt {i} step {step}: got {token}, want {token_want}")
            break
          if step + 1 < len(want):
            out = runner.step([SeqChunk([token], len(ids) + step, table)])
            logits = np.asarray(out.logits_SV[0])
    self.assertTrue(checked_keys)
    # A stored first chunk (K before RoPE, V) inserted, rotated at insertion with the model's
    # own rope_theta, then the next chunk computed: the logits of computing both chunks.
    ids = ref["prompt_ids_3"].tolist()
    runner.reset()
    first = runner.step([SeqChunk(ids[:CHUNK], 0, table)])
    computed = runner.step([SeqChunk(ids[CHUNK:2 * CHUNK], CHUNK, table)]).logits_SV[0]
    kv = np.stack([np.asarray(first.k_pre_rope_LTKH), np.asarray(first.v_LTKH)], axis=1)
    runner.reset()
    runner.insert_chunk(kv, table[:CHUNK // 16], 0)
    hit = runner.step([SeqChunk(ids[CHUNK:2 * CHUNK], CHUNK, table)]).logits_SV[0]
    np.testing.assert_allclose(np.asarray(hit), np.asarray(computed), atol=1e-4, rtol=0)

  def test_logits_and_greedy_match_transformers(self):
    # The family furthest from LLaMA (q/k norm, a head_dim wider than d_model / heads): 17
    # tokens (one chunk) and 200 (three chunks of 64 and one of 8), three greedy steps; every
    # family (qwen2's biases and tied embeddings among them), every prompt (1, 17, 70, 200
    # tokens) and all 8 steps is the slow test below (each family compiles its own programs:
    # about 5-8 s of a quiet 2-core machine, which the default suite's budget cannot give all).
    self.check_family("qwen3", prompts=(1, 3), num_greedy=3)

  @parameterized.parameters(*FAMILIES)
  @pytest.mark.slow
  def test_logits_and_greedy_match_transformers_all_prompts(self, family):
    self.check_family(family, prompts=range(4), num_greedy=None)

  def test_each_family_reads_its_switches(self):
    cfgs = {f: safetensors_loader.read_safetensors_config(folder(f)) for f in FAMILIES}
    self.assertEqual({f: c.family for f, c in cfgs.items()}, {f: f for f in FAMILIES})
    switches = {f: (c.attention_bias, c.qk_norm, c.tie_embeddings, c.head_dim, c.n_kv_heads,
                    c.rope_theta, c.max_seq_len) for f, c in cfgs.items()}
    self.assertEqual(switches, {
        "llama": (False, False, False, 16, 2, 500000.0, 512),
        "mistral": (False, False, False, 16, 1, 1000000.0, 256),  # the sliding window
        "qwen2": (True, False, True, 16, 2, 1000000.0, 512),
        "qwen3": (False, True, False, 32, 2, 1000000.0, 512),
    })
    self.assertEqual(cfgs["llama"].rope_scaling, config_lib.RopeScaling(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=64))
    self.assertIsNone(cfgs["qwen2"].rope_scaling)
    shards = sorted(p for p in os.listdir(folder("qwen3")) if p.endswith(".safetensors"))
    self.assertLen(shards, 3)
    self.assertTrue(os.path.isfile(os.path.join(folder("qwen3"), "model.safetensors.index.json")))

  def test_special_tokens_and_chat_templates(self):
    refs = references()["families"]
    for family in FAMILIES:
      with self.subTest(family=family):
        tok = load_model(folder(family), cache_dir=None).tokenizer
        self.assertEqual((tok.bos_id, tok.eos_id),
                         (refs[family]["bos_token_id"], refs[family]["eos_token_id"]))
        self.assertNotEmpty(refs[family]["chat"])
        for case in refs[family]["chat"]:
          self.assertEqual(tok.apply_chat_template(case["messages"],
                                                   case["add_generation_prompt"]), case["text"])
          self.assertEqual(tok.encode_chat(case["messages"], case["add_generation_prompt"]),
                           case["ids"])

  def test_eos_falls_back_to_generation_config(self):
    work = os.path.join(self.create_tempdir().full_path, "qwen2")
    shutil.copytree(folder("qwen2"), work)
    path = os.path.join(work, "tokenizer_config.json")
    tok_config = json.loads(pathlib.Path(path).read_text())
    del tok_config["eos_token"]
    pathlib.Path(path).write_text(json.dumps(tok_config))
    gen_path = os.path.join(work, "generation_config.json")
    gen = json.loads(pathlib.Path(gen_path).read_text())
    gen["eos_token_id"] = [7, 2]
    pathlib.Path(gen_path).write_text(json.dumps(gen))
    self.assertEqual(load_model(work, cache_dir=None).tokenizer.eos_id, 7)

  def test_fingerprints_differ_between_families(self):
    fps = {f: load_model(folder(f), cache_dir=None).fingerprint for f in FAMILIES}
    self.assertLen(set(fps.values()), len(FAMILIES))
    # The same tensors under another family's name still get another fingerprint: a Mistral
    # and a LLaMA checkpoint never share stored chunks.
    llama = load_model(folder("llama"), cache_dir=None)
    as_mistral = dataclasses.replace(llama.config, family="mistral")
    self.assertNotEqual(model_fingerprint(as_mistral, llama.params), llama.fingerprint)
    self.assertEqual(model_fingerprint(llama.config, llama.params), llama.fingerprint)

  def test_unsupported_architecture_names_the_supported_ones(self):
    work = os.path.join(self.create_tempdir().full_path, "gpt2")
    shutil.copytree(folder("qwen2"), work)
    path = os.path.join(work, "config.json")
    hf = json.loads(pathlib.Path(path).read_text())
    hf.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    pathlib.Path(path).write_text(json.dumps(hf))
    supported = ("LlamaForCausalLM.*MistralForCausalLM.*Qwen2ForCausalLM.*Qwen3ForCausalLM")
    with self.assertRaisesRegex(ValueError, "GPT2LMHeadModel.*" + supported):
      load_model(work, cache_dir=None)

  def test_o_proj_bias_and_mismatched_model_type_are_refused(self):
    base = safetensors_loader.config_to_hf(
        safetensors_loader.read_safetensors_config(folder("qwen3")))
    for changes, regex in ((dict(attention_bias=True), "attention_bias=true.*qwen3"),
                           (dict(model_type="qwen2"), "model_type 'qwen2'.*'qwen3'"),
                           (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0}),
                            "'yarn'")):
      with self.subTest(changes=changes):
        with self.assertRaisesRegex(ValueError, regex):
          safetensors_loader.config_from_hf({**base, **changes}, "x")


class FamilyEngineTest(absltest.TestCase):
  """Qwen3 (q/k norm, rope_theta 1e6, head_dim 32) through `LLM`: prefill and decode equal the
  oracle's greedy tokens, and a stored prefix (raw codec: keys before RoPE, rotated back with
  the model's own frequencies at load) gives the cold run's tokens."""

  FAMILY = "qwen3"

  def test_greedy_equals_oracle_and_store_hit_equals_cold(self):
    loaded = load_model(folder(self.FAMILY), cache_dir=None)
    prompt = [int(t) for t in np.random.default_rng(3).integers(0, 384, 150)]
    params = SamplingParams(max_tokens=6, temperature=0.0)
    store = f"file://{self.create_tempdir().full_path}"
    llm = real_llm(folder(self.FAMILY), cache_dir="", max_num_seqs=2, chunk_sizes=(16, 32, 64),
                   kv_store=store, kv_chunk_size=32, kv_codec="raw", kv_merge_mode="load_only",
                   enable_prefix_caching=False)
    cold = llm.generate({"prompt_token_ids": prompt}, params)[0]
    llm.flush()
    self.assertEqual(cold.token_ids, oracle.oracle_greedy(loaded.config, loaded.params, prompt,
                                                          6))
    self.assertEqual(cold.num_cached_tokens, 0)
    warm = llm.generate({"prompt_token_ids": prompt}, params)[0]
    self.assertEqual((warm.num_cached_tokens, warm.metrics.num_loaded_tokens), (128, 128))
    self.assertEqual(warm.token_ids, cold.token_ids)
    llm.close()


@pytest.mark.slow
class Qwen2EngineTest(FamilyEngineTest):
  """The same on Qwen2 (biases on q, k and v: the stored K carries its bias)."""

  FAMILY = "qwen2"


if __name__ == "__main__":
  absltest.main()
