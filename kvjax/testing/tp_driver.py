"""Tensor-parallel checks in a process of their own, for `tests/integration/models/tensor_parallel_test.py`.

The host-platform device count is fixed when jax starts, so the test suite (one CPU device)
runs this module in a subprocess with `XLA_FLAGS=--xla_force_host_platform_device_count=8`:

    python -m kvjax.testing.tp_driver --model=tiny-tp --sizes=1,2,4,8 --out=/tmp/tp.json

For each size N it serves the same prompts twice on one shared file store: cold (and saving),
then from a fresh `LLM` of the next size that hits the chunks the previous one saved (sizes in
a ring, so a chunk saved at N = 1 is hit at N = 2 and one saved at the last N is hit at N = 1).
It writes, per run, the greedy token ids, the first token's top log-probs and the cached token
counts, plus the error message of each `LLM(...)` that must be refused. The test compares them.
"""

from __future__ import annotations

import json
import tempfile

import numpy as np
from absl import app, flags

_MODEL = flags.DEFINE_string("model", "tiny-tp", "Model name.")
_SIZES = flags.DEFINE_list("sizes", ["1", "2"], "tensor_parallel_size values, the first is 1.")
_LENGTHS = flags.DEFINE_list("lengths", ["5", "40", "130"], "Prompt lengths, tokens.")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 6, "Greedy tokens per prompt.")
_CHUNK = flags.DEFINE_integer("kv_chunk_size", 32, "Store chunk size, tokens.")
_REFUSE = flags.DEFINE_list("refuse", [], "model:N that LLM(...) must refuse (ValueError).")
_PAYLOADS = flags.DEFINE_list(
    "payload_codecs", [], "Codecs whose stored payload each size decodes per shard into the "
    "pool (`insert_payload`); the blocks read back are compared with N = 1.")
_OUT = flags.DEFINE_string("out", None, "JSON output path.", required=True)


def _prompts(vocab: int) -> list[list[int]]:
  return [[int(t) for t in np.random.default_rng(i).integers(0, vocab, int(n))]
          for i, n in enumerate(_LENGTHS.value)]


def _run(llm, prompts, params) -> list[dict]:
  outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
  return [{"token_ids": o.token_ids,
           "logprobs": {str(k): v for k, v in o.logprobs[0].items()},
           "num_cached_tokens": o.num_cached_tokens} for o in outs]


def _decode_payloads(llm) -> dict:
  """Decodes one random chunk's payload of each codec into the pool (`insert_payload`: the codec
  kernel per shard), returning the K and V blocks read back (after the engine's last request)."""
  from kvjax.testing import codec_payloads  # noqa: PLC0415
  cfg, runner = llm.model_config, llm.engine.runner
  c = _CHUNK.value
  kv = codec_payloads.random_kv((cfg.n_layers, 2, c, cfg.n_kv_heads, cfg.head_dim), seed=7)
  blocks = list(range(runner.num_blocks - c // runner.block_size, runner.num_blocks))
  out = {}
  for codec in _PAYLOADS.value:
    level = 1 if codec == "cachegen" else 0
    runner.insert_payload(codec, codec_payloads.encode(codec, level, kv), blocks, 2 * c)
    out[codec] = np.stack([np.asarray(a) for a in runner.read_blocks(blocks)]).tolist()
  return out


def main(argv):
  del argv
  import jax  # noqa: PLC0415
  from kvjax import LLM, SamplingParams  # noqa: PLC0415

  sizes = [int(s) for s in _SIZES.value]
  params = SamplingParams(max_tokens=_MAX_TOKENS.value, temperature=0.0, logprobs=5)
  opts = dict(cache_dir="", chunk_sizes=(16, 32, 64), block_size=16, max_num_seqs=4,
              max_model_len=512, kv_chunk_size=_CHUNK.value, startup_progress=None)
  result = {"devices": jax.device_count(), "runs": {}, "refused": {}, "payload_blocks": {}}
  with tempfile.TemporaryDirectory() as root:
    prompts = None
    for i, n in enumerate(sizes):
      store = f"file://{root}/store{i}"
      llm = LLM(_MODEL.value, tensor_parallel_size=n, kv_store=store, **opts)
      prompts = prompts or _prompts(llm.model_config.vocab_size)
      shardings = {
          "pool": str(getattr(llm.engine.runner.pool.k_LPBF.sharding, "spec", None)),
          "pool_shape": list(llm.engine.runner.pool.k_LPBF.shape),
          "pool_shard_shape": list(
              llm.engine.runner.pool.k_LPBF.addressable_shards[0].data.shape)}
      # KV heads in the pool and in one device's shard (the last axis folds K' * H).
      h_ = llm.model_config.head_dim
      shardings["pool_heads"] = shardings["pool_shape"][3] // h_
      shardings["pool_shard_heads"] = shardings["pool_shard_shape"][3] // h_
      cold = _run(llm, prompts, params)
      llm.flush()
      llm.close()
      # The next size in the ring hits what this one saved. Load-only: every stored chunk is
      # loaded, whatever the machine's speed (Cake's meeting point follows measured times, so
      # under load it may compute the whole prompt and load nothing).
      m = sizes[(i + 1) % len(sizes)]
      llm = LLM(_MODEL.value, tensor_parallel_size=m, kv_store=store, kv_merge_mode="load_only",
                **opts)
      hit = _run(llm, prompts, params)
      if _PAYLOADS.value:
        result["payload_blocks"][str(m)] = _decode_payloads(llm)
      llm.close()
      result["runs"][str(n)] = {"cold": cold, "hit_by": m, "hit": hit, **shardings}
  for pair in _REFUSE.value:
    model, n = pair.split(":")
    try:
      LLM(model, tensor_parallel_size=int(n), **opts).close()
      result["refused"][pair] = None
    except ValueError as e:
      result["refused"][pair] = str(e)
  with open(_OUT.value, "w", encoding="utf-8") as f:
    json.dump(result, f)


if __name__ == "__main__":
  app.run(main)
