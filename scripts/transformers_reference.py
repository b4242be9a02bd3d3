"""What the reference-fixture scripts ask of transformers (scripts/make_reference_fixtures.py,
scripts/make_family_fixtures.py): last-position logits and greedy tokens from full cache-free
forwards, chat-template ids, package versions. Needs torch and transformers (fixture scripts
only; never the tests or the package)."""

from __future__ import annotations

import importlib.metadata

import numpy as np
import torch


def version(pkg: str) -> str | None:
  """The installed version of `pkg`, or None."""
  try:
    return importlib.metadata.version(pkg)
  except importlib.metadata.PackageNotFoundError:
    return None


def as_ids(result) -> list[int]:
  """Token ids of `apply_chat_template(tokenize=True)` (a BatchEncoding in transformers 5)."""
  if hasattr(result, "keys") and "input_ids" in result:
    result = result["input_ids"]
  return [int(t) for t in result]


@torch.no_grad()
def last_logits(model, ids) -> np.ndarray:
  """float32 logits `[V]` at the last position of one full (cache-free) forward pass."""
  out = model(input_ids=torch.tensor([ids], dtype=torch.long), use_cache=False)
  return out.logits[0, -1].to(torch.float32).numpy()


@torch.no_grad()
def greedy(model, ids, n: int) -> tuple[np.ndarray, np.ndarray]:
  """n greedy steps, each a full cache-free forward (no EOS stop); returns (int32 ids `[n]`,
  float32 top1 - top2 logit gaps `[n]`)."""
  ids, new, gaps = list(ids), [], []
  for _ in range(n):
    logits = last_logits(model, ids)
    top2 = np.argsort(-logits, kind="stable")[:2]
    new.append(int(top2[0]))
    gaps.append(float(logits[top2[0]] - logits[top2[1]]))
    ids.append(int(top2[0]))
  return np.array(new, np.int32), np.array(gaps, np.float32)
