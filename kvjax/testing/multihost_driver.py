"""One process of a multi-host run over 127.0.0.1, for `tests/integration/models/multihost_test.py`.

Every process runs this same program with its own `--process_id`:

    XLA_FLAGS=--xla_force_host_platform_device_count=2 python -m kvjax.testing.multihost_driver \
        --num_processes=2 --process_id=0 --coordinator_address=127.0.0.1:PORT --out=/tmp/r.json
    (and the same with --process_id=1)

Two `LLM`s in turn, both over every device of every process (`tensor_parallel_size` = global
device count) on one file store: the first serves the prompts cold and saves their chunks, the
second (a fresh pool) serves them again from the store. Process 0 runs the engines and writes
the greedy tokens, first-token log-probs and cached token counts; the others follow. With
`--num_processes=1` it is the single-process reference on the same total device count.
"""

from __future__ import annotations

import json

import numpy as np
from absl import app, flags

_MODEL = flags.DEFINE_string("model", "tiny-tp", "Model name.")
_NUM = flags.DEFINE_integer("num_processes", 1, "Processes in the run.")
_PID = flags.DEFINE_integer("process_id", 0, "This process.")
_COORD = flags.DEFINE_string("coordinator_address", None, "host:port of process 0.")
_STORE = flags.DEFINE_string("kv_store", None, "Store URL (shared by every process).",
                             required=True)
_OUT = flags.DEFINE_string("out", None, "JSON output path (process 0).")
_LENGTHS = (5, 40, 130)


def main(argv):
  del argv
  from kvjax import LLM, SamplingParams  # noqa: PLC0415

  params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=5)
  prompts = [{"prompt_token_ids": [int(t) for t in np.random.default_rng(i).integers(0, 256, n)]}
             for i, n in enumerate(_LENGTHS)]
  result = {}
  for phase in ("cold", "hit"):
    import jax  # noqa: PLC0415
    multi = dict(coordinator_address=_COORD.value, num_processes=_NUM.value,
                 process_id=_PID.value) if _NUM.value > 1 else {}
    # jax.distributed starts with the first LLM; the device count is known after it.
    llm = LLM(_MODEL.value, cache_dir="", chunk_sizes=(16, 32, 64), block_size=16,
              max_num_seqs=4, max_model_len=512, kv_store=_STORE.value, kv_chunk_size=32,
              tensor_parallel_size=_total_devices(multi), startup_progress=None, **multi)
    if llm.is_follower:
      llm.follow()
      continue
    outs = llm.generate(prompts, params)
    llm.flush()
    result[phase] = [{"token_ids": o.token_ids,
                      "logprobs": {str(k): v for k, v in o.logprobs[0].items()},
                      "num_cached_tokens": o.num_cached_tokens} for o in outs]
    result["devices"] = jax.device_count()
    result["processes"] = jax.process_count()
    llm.close()
  if _PID.value == 0 and _OUT.value:
    with open(_OUT.value, "w", encoding="utf-8") as f:
      json.dump(result, f)


def _total_devices(multi: dict) -> int:
  """Every device of every process (initializes jax.distributed first when multi-host)."""
  import jax  # noqa: PLC0415
  from kvjax.models.runner.sharding import initialize_distributed  # noqa: PLC0415
  if multi:
    initialize_distributed(multi["coordinator_address"], multi["num_processes"],
                           multi["process_id"])
  return jax.device_count()


if __name__ == "__main__":
  app.run(main)
