"""How much the server's default store grows under small chat sessions, and whether a session
survives a restart.

Builds the `LLM` the way `python -m kvjax.serve` does
(`LLM(options=ServerConfig.from_flat(...).engine)`, the default store's options) over a fresh
store folder, runs `--conversations` ShareGPT conversations of `--turns` user turns each
through `LLM.chat(..., session_id=...)` (greedy, `--max_tokens`), then measures the store folder (records' bytes and files on disk). Then it
closes the `LLM`, builds a new one over the same folder (a restart) and sends the next turn of
the first conversation with the same session id and salt: its outcome ("extended" or "first")
and cached tokens, against the tokens the previous turns left (`history`).

    PYTHONPATH=$PWD python scripts/store_growth.py --out benchmarks/results/store_growth.json
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import benchlib  # noqa: E402

from kvjax import SamplingParams  # noqa: E402
from kvjax.entrypoints import builder  # noqa: E402
from kvjax.serve.server import ServerConfig  # noqa: E402

DATA = benchlib.REPO.parent / "shared" / "data" / "sharegpt" / "sharegpt_v3_multiturn_1000.json"


def conversations(n: int, turns: int, chars: int, seed: int) -> list[list[str]]:
  data = json.loads(DATA.read_text(encoding="utf-8"))
  out = []
  for conv in data:
    users = [m["value"][:chars] for m in conv["conversations"] if m["from"] == "human"]
    users = [u for u in users if u.strip()]
    if len(users) > turns:  # one more for the turn after the restart
      out.append(users[:turns + 1])
  random.Random(seed).shuffle(out)
  return out[:n]


def folder_bytes(path: str) -> tuple[int, int]:
  files = nbytes = 0
  for root, _, names in os.walk(path):
    for name in names:
      try:
        nbytes += os.stat(os.path.join(root, name)).st_size
        files += 1
      except OSError:
        pass
  return files, nbytes


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--conversations", type=int, default=14)
  p.add_argument("--turns", type=int, default=3)
  p.add_argument("--turn_chars", type=int, default=300)
  p.add_argument("--max_tokens", type=int, default=16)
  p.add_argument("--capacity_bytes", type=int, default=None,
                 help="--kv_store_capacity_bytes (default: the server's default)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", default=None)
  args = p.parse_args()
  prov = benchlib.provenance(("kvjax", "jax", "jaxlib", "numpy", "tensorstore"))

  store = tempfile.mkdtemp(prefix="kvjax-store-growth-")
  config = ServerConfig.from_flat(kv_store=f"file://{store}",
                                  kv_store_capacity_bytes=args.capacity_bytes)
  convs = conversations(args.conversations, args.turns, args.turn_chars, args.seed)
  params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)

  def build():
    return builder.build_llm(options=config.engine)

  llm = build()
  t0 = time.perf_counter()
  requests, histories = 0, []
  try:
    for i, users in enumerate(convs):
      messages: list[dict] = []
      for user in users[:args.turns]:
        messages.append({"role": "user", "content": user})
        (out,) = llm.chat(messages, params, session_id=f"conv-{i}", cache_salt="growth")
        messages.append({"role": "assistant", "content": out.text})
        requests += 1
      histories.append(messages)
    llm.flush()
    last = llm.sessions.get("conv-0", "growth")
  finally:
    llm.close()
  wall_s = time.perf_counter() - t0
  files, disk = folder_bytes(store)
  index_files, _ = folder_bytes(os.path.join(store, "index"))

  llm = build()  # the restart
  try:
    messages = histories[0] + [{"role": "user", "content": convs[0][args.turns]}]
    (out,) = llm.chat(messages, params, session_id="conv-0", cache_salt="growth")
    prompt = llm.last_session_prompt
    restart = {"outcome": prompt.outcome, "cached_tokens": out.num_cached_tokens,
               "prompt_tokens": len(out.prompt_token_ids),
               "history_tokens_with_kv": len(last.token_ids) - 1}
  finally:
    llm.close()

  result = {
      **prov, "seed": args.seed,
      "config": {"model": config.model, "dtype": config.engine.model.dtype,
                 "kv_chunk_size": config.engine.kv.kv_chunk_size,
                 "store_tiers": repr(config.engine.kv.store_config()),
                 **{k: v for k, v in vars(args).items() if k != "out"}},
      "chat_requests": requests, "wall_s": round(wall_s, 1),
      "store_files": files, "store_disk_bytes": disk, "store_chunks": index_files,
      "restart": restart,
  }
  if args.out:
    benchlib.write_json(args.out, result)
  else:
    benchlib.finish(result)
  print(json.dumps(result, indent=1))


if __name__ == "__main__":
  main()
