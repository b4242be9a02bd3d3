"""The load-back correctness matrix: every way kvjax reads KV back, checked against a cold run.

    python scripts/loadback_matrix.py            # the full matrix (minutes on 2 CPU cores)
    python scripts/loadback_matrix.py --quick    # a slice (seconds; run by the default suite)

A load-back is one request whose prompt KV was (partly) served by a cache tier instead of being
computed. Cells are tier x codec x event:

  tier    device (the device prefix cache over a disk store), host (a host tier over a disk
          store), disk (a file store), s3 (an S3 store on a local moto server)
  codec   raw (lossless), int8, int4, cachegen (lossy; the fake runner,
          `kvjax.testing.engines.fake_llm`), kvtc (lossy; the real tiny model, `real_llm`)
  event   fresh     the prompts run twice on one engine (the second pass loads)
          restart   stored by one engine, loaded by a new one on the same store
          demote    a small write-back host tier: the prompts' chunks are demoted below it by
                    other prompts, loaded back from the tier below (and promoted), then loaded
                    from the host (the device cell drops its device copy first)
          churn     32 requests at once (each prompt twice, shuffled; 32 sequences running),
                    saves and loads in flight together, then 32 again in another order
          crash     stored by one engine; then every other stored chunk is left as a crash
                    during its save leaves it (a torn data object, no index record: records are
                    published last); a new engine loads what survived, recomputes and re-saves
                    the rest, then loads everything

Prompts are prefixes of one token sequence with lengths at chunk (C = 32) and block (16) edges,
so prompts share prefixes and load each other's chunks. Every request's output is compared with
its reference: raw (lossless) with a cold run without a store, token for token and logprobs
within 1e-5; a lossy codec with a cold run of the same codec in `kv_codec_consistent` mode (each
prompt under its own cache salt, so it loads nothing): token for token, across repeats, engines
and orders (their largest logprob difference is recorded, not judged). A request that differs
is wrong; a cell whose warm pass loads nothing from its tier fails (it would test nothing).
Engines run `kv_merge_mode="load_only"` so every stored chunk found is loaded.

Writes benchmarks/results/loadback_matrix.json (provenance from scripts/benchlib.py) and prints
a table; the last line reads "<N> load-backs, <K> wrong". Exits non-zero when a load-back is
wrong, a cell fails or cannot run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import pathlib
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from absl import app, flags, logging
import numpy as np

import benchlib  # scripts/benchlib.py
from kvjax import SamplingParams
from kvjax.storage import StoreConfig, TierConfig
from kvjax.storage.backends.chunk_store import ChunkStore, index_key, run_sync
from kvjax.testing import engines

REPO = pathlib.Path(__file__).resolve().parents[1]

TIERS = ("device", "host", "disk", "s3")
CODECS = ("raw", "int8", "int4", "cachegen", "kvtc")
EVENTS = ("fresh", "restart", "demote", "churn", "crash")
#: What each tier is called in `RequestMetrics.loaded_from_tiers`.
TIER_NAME = {"device": "device", "host": "host", "disk": "disk", "s3": "remote"}
LOSSLESS = ("raw",)
#: Tokens per stored chunk and per device block.
C, BLOCK = 32, 16
#: Prompt lengths at chunk and block edges (a prompt of n tokens may load (n - 1) // C chunks).
EDGE_LENGTHS = (33, 47, 48, 49, 63, 64, 65, 95, 96, 97, 111, 112, 113, 128, 129, 161)
#: Requests of a churn event at once.
CHURN = 32
LOGPROB_TOL = 1e-5
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, logprobs=1)
BUCKET = "kvjax-loadback"


@dataclasses.dataclass(frozen=True)
class Plan:
  """What to run: the cells (the product of tiers, codecs and events) and the prompts."""

  tiers: tuple[str, ...]
  codecs: tuple[str, ...]
  events: tuple[str, ...]
  lengths: tuple[int, ...] = EDGE_LENGTHS
  seed: int = 0

  def cells(self) -> list[tuple[str, str, str]]:
    return list(itertools.product(self.tiers, self.codecs, self.events))


QUICK = Plan(tiers=("host", "disk"), codecs=("raw", "int8"), events=("fresh", "restart"),
             lengths=(65, 97))


@dataclasses.dataclass
class Reference:
  """A prompt's reference answer: tokens and each token's logprob."""

  token_ids: list[int]
  logprobs: list[float]


def _logprobs(out) -> list[float]:
  return [float(d[t]) for t, d in zip(out.token_ids, out.logprobs or [])]


@dataclasses.dataclass
class CellResult:
  """One cell's outcome: requests checked, load-backs (requests served by the cell's tier),
  wrong answers (all of them, with their prompts), and an error if it could not run."""

  tier: str
  codec: str
  event: str
  requests: int = 0
  loadbacks: int = 0
  loaded_chunks: int = 0
  wrong: list[dict] = dataclasses.field(default_factory=list)
  max_logprob_diff: float = 0.0
  error: str = ""
  seconds: float = 0.0

  @property
  def ok(self) -> bool:
    return not self.error and not self.wrong and self.loadbacks > 0


class Matrix:
  """Runs the cells of a `Plan` in a scratch folder (and one moto server for s3 cells)."""

  def __init__(self, plan: Plan, work_dir: str):
    self.plan = plan
    self.work_dir = work_dir
    rng = np.random.default_rng(plan.seed)
    n = max(plan.lengths)
    self.base = [int(t) for t in rng.integers(0, 256, n)]
    # Unrelated prompts that push the matrix's chunks out of a small host tier.
    self.flushers = [[int(t) for t in rng.integers(0, 256, n)] for _ in range(3)]
    self.churn_orders = [rng.permutation(2 * len(plan.lengths)) for _ in range(2)]
    self.refs: dict[str, dict[int, Reference]] = {}
    self.host_chunk_bytes: dict[str, int] = {}
    self._ids = itertools.count()
    self._s3 = None

  # -- engines ------------------------------------------------------------------------------

  def build(self, codec: str, store: Any, *, prefix_caching: bool = False,
            max_num_seqs: int = 8):
    """An `LLM` of the cell's codec over `store` (fake runner; the real tiny model for kvtc)."""
    options = dict(kv_store=store, kv_chunk_size=C, block_size=BLOCK, kv_codec=codec,
                   kv_merge_mode="load_only", enable_prefix_caching=prefix_caching,
                   max_num_seqs=max_num_seqs)
    if codec == "kvtc":
      return engines.real_llm("tiny", cache_dir=os.path.join(self.work_dir, "cache"),
                              **options)
    return engines.fake_llm(chunk_sizes=(16, 32, 64), **options)

  def prompt(self, n: int) -> list[int]:
    return self.base[:n]

  def reference(self, codec: str) -> dict[int, Reference]:
    """Cold answers: raw without a store; a lossy codec in consistent mode, each prompt under
    its own cache salt (so nothing is loaded)."""
    if codec not in self.refs:
      lossless = codec in LOSSLESS
      llm = self.build(codec, None if lossless else engines.memory_store_url("ref"))
      refs = {}
      for n in self.plan.lengths:
        prompt = {"prompt_token_ids": self.prompt(n)}
        if not lossless:
          prompt["cache_salt"] = f"reference-{n}"
        out = llm.generate(prompt, PARAMS)[0]
        if out.num_cached_tokens:
          raise RuntimeError(f"the {codec} reference of {n} tokens loaded KV")
        refs[n] = Reference(list(out.token_ids), _logprobs(out))
      llm.close()
      self.refs[codec] = refs
    return self.refs[codec]

  def persistent_url(self, tier: str) -> str:
    name = f"cell-{next(self._ids)}"
    if tier == "s3":
      return f"s3://{BUCKET}/{name}"
    return f"file://{os.path.join(self.work_dir, name)}"

  def host_bytes(self, codec: str) -> int:
    """Bytes one chunk of `codec` takes in a host tier (measured once per codec)."""
    if codec not in self.host_chunk_bytes:
      config = StoreConfig((TierConfig("host", capacity_bytes=1 << 30),
                            TierConfig("disk", url=engines.memory_store_url("probe"))))
      llm = self.build(codec, config)
      llm.generate({"prompt_token_ids": self.flushers[0][:C + 1]}, PARAMS)
      llm.flush()
      (usage,) = [t for t in llm.engine.stats().tiers if t.name == "host"]
      llm.close()
      if usage.written_bytes <= 0:
        raise RuntimeError(f"a {codec} host tier stored nothing")
      self.host_chunk_bytes[codec] = usage.written_bytes
    return self.host_chunk_bytes[codec]

  def store_for(self, tier: str, codec: str, event: str) -> tuple[Any, str]:
    """The cell's store (a URL or a `StoreConfig`) and the URL of its persistent tier."""
    url = self.persistent_url(tier)
    kind = "remote" if tier == "s3" else "disk"
    if event == "demote":  # a write-back host tier of 3 chunks over the persistent tier
      return StoreConfig((TierConfig("host", capacity_bytes=3 * self.host_bytes(codec)),
                          TierConfig(kind, url=url)), placement="write_back"), url
    if tier == "host":
      return StoreConfig((TierConfig("host", capacity_bytes=1 << 30),
                          TierConfig("disk", url=url))), url
    return url, url

  @contextlib.contextmanager
  def s3(self) -> Iterator[None]:
    """A moto S3 server with the bucket, and its endpoint and fake credentials in the
    environment, while the s3 cells run."""
    import boto3  # noqa: PLC0415  (the [test] extra, as tests/integration/storage/s3_test.py)
    from kvjax.testing.s3 import MotoServer  # noqa: PLC0415
    server = MotoServer()
    server.start()
    env = {"AWS_ACCESS_KEY_ID": "kvjax-test", "AWS_SECRET_ACCESS_KEY": "kvjax-test",
           "AWS_REGION": "us-east-1", "AWS_ENDPOINT_URL": server.endpoint}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
      boto3.client("s3", endpoint_url=server.endpoint, region_name="us-east-1").create_bucket(
          Bucket=BUCKET)
      yield
    finally:
      for k, v in saved.items():
        if v is None:
          os.environ.pop(k, None)
        else:
          os.environ[k] = v
      server.stop()

  # -- one cell -----------------------------------------------------------------------------

  def run_cell(self, tier: str, codec: str, event: str) -> CellResult:
    res = CellResult(tier, codec, event)
    t0 = time.perf_counter()
    try:
      refs = self.reference(codec)
      self._run_event(res, refs, tier, codec, event)
      if not res.error and res.loadbacks == 0:
        res.error = f"no request loaded from the {tier} tier"
    except Exception as e:  # noqa: BLE001 - a cell that cannot run is reported, not raised
      res.error = f"{type(e).__name__}: {e}"
      logging.error("cell %s/%s/%s failed:\n%s", tier, codec, event, traceback.format_exc())
    res.seconds = time.perf_counter() - t0
    return res

  def _check(self, res: CellResult, refs: dict[int, Reference], codec: str, tier: str,
             outs: Sequence, lengths: Sequence[int], counted: bool = True) -> None:
    """Compares each output with its reference; counts the load-backs the cell's tier served."""
    for n, out in zip(lengths, outs):
      res.requests += 1
      ref = refs[n]
      served = set(out.metrics.loaded_from_tiers)
      if out.metrics.num_device_cached_tokens:
        served.add("device")
      from_tier = counted and TIER_NAME[tier] in served
      if from_tier:
        res.loadbacks += 1
        res.loaded_chunks += sum(1 for t in out.metrics.loaded_from_tiers if t == TIER_NAME[tier])
      bad = list(out.token_ids) != ref.token_ids
      diff = 0.0
      if not bad:  # lossy: recorded, not judged (the criterion is the tokens)
        got = _logprobs(out)
        diff = max((abs(a - b) for a, b in zip(got, ref.logprobs)), default=0.0)
        res.max_logprob_diff = max(res.max_logprob_diff, diff)
        if codec in LOSSLESS:
          bad = len(got) != len(ref.logprobs) or diff > LOGPROB_TOL
      if bad:
        res.wrong.append({"prompt_tokens": n, "served_by": sorted(served),
                          "cached_tokens": out.num_cached_tokens, "token_ids": list(out.token_ids),
                          "reference": ref.token_ids, "logprob_diff": diff})

  def _pass(self, llm, lengths: Sequence[int], *, together: bool = False) -> list:
    """Runs prompts one after another (or all in one `generate` call), then waits for saves."""
    prompts = [{"prompt_token_ids": self.prompt(n)} for n in lengths]
    outs = (llm.generate(prompts, PARAMS) if together
            else [llm.generate(p, PARAMS)[0] for p in prompts])
    llm.flush()
    return outs

  def _run_event(self, res: CellResult, refs, tier: str, codec: str, event: str) -> None:
    store, url = self.store_for(tier, codec, event)
    device = tier == "device"
    lengths = list(self.plan.lengths)

    def build(**kw):
      return self.build(codec, store, prefix_caching=device, **kw)

    def check(outs, order=lengths, counted=True):
      self._check(res, refs, codec, tier, outs, order, counted)

    if event == "fresh":
      llm = build()
      check(self._pass(llm, lengths))  # shared prefixes: later prompts load earlier ones' chunks
      check(self._pass(llm, lengths))
      llm.close()
    elif event in ("restart", "crash"):
      llm = build()
      check(self._pass(llm, lengths), counted=False)
      llm.close()
      if event == "crash":
        self.tear(url, every=2)
      llm = build()
      check(self._pass(llm, lengths), counted=tier in ("disk", "s3"))
      check(self._pass(llm, lengths))
      llm.close()
    elif event == "demote":
      llm = build()
      check(self._pass(llm, lengths), counted=False)
      for f in self.flushers:  # unrelated prompts: the host tier demotes the matrix's chunks
        llm.generate({"prompt_token_ids": f}, PARAMS)
      llm.flush()
      if device:
        llm.reset_prefix_cache()
      check(self._pass(llm, lengths), counted=tier in ("disk", "s3"))
      check(self._pass(llm, lengths), counted=tier in ("host", "device"))
      llm.close()
    elif event == "churn":
      llm = build(max_num_seqs=CHURN)
      doubled = lengths + lengths
      for k, order in enumerate(self.churn_orders):
        batch = [doubled[i] for i in order][:CHURN]
        check(self._pass(llm, batch, together=True), batch, counted=k > 0 or device)
      llm.close()
    else:
      raise ValueError(f"unknown event {event!r}")

  def tear(self, url: str, every: int) -> int:
    """Leaves every `every`-th stored chunk (by key) as a crash during its save does: its data
    objects cut to half their bytes, its index record gone (records are written last). Returns
    how many it tore."""
    store = ChunkStore(url)

    async def tear_all():
      root = await store.kvstore()
      records = sorted(await store.records(), key=lambda r: r.chunk_hash)[::every]
      for rec in records:
        await root.write(index_key(rec.chunk_hash), None)
        for enc in rec.encodings:
          got = await root.read(enc.object)
          if got.state == "value":
            await root.write(enc.object, bytes(got.value)[:len(got.value) // 2])
      return len(records)

    try:
      torn = run_sync(tear_all())
    finally:
      store.close()
    if not torn:
      raise RuntimeError(f"nothing stored at {url} to tear")
    return torn

  def run(self, on_cell: Callable[[CellResult], None] = lambda r: None) -> list[CellResult]:
    cells = self.plan.cells()
    out = []
    local = [c for c in cells if c[0] != "s3"]
    remote = [c for c in cells if c[0] == "s3"]
    for tier, codec, event in local:
      out.append(self.run_cell(tier, codec, event))
      on_cell(out[-1])
    if remote:
      with self.s3():
        for tier, codec, event in remote:
          out.append(self.run_cell(tier, codec, event))
          on_cell(out[-1])
    return out


def table(results: Sequence[CellResult]) -> str:
  """One line per cell, then the totals' line "<N> load-backs, <K> wrong"."""
  head = f"{'tier':<7} {'codec':<9} {'event':<8} {'requests':>8} {'load-backs':>10} " \
         f"{'chunks':>7} {'wrong':>5} {'max |dlogp|':>11}  status"
  lines = [head, "-" * len(head)]
  for r in results:
    status = "ok" if r.ok else ("WRONG" if r.wrong else f"FAILED: {r.error}")
    lines.append(f"{r.tier:<7} {r.codec:<9} {r.event:<8} {r.requests:>8} {r.loadbacks:>10} "
                 f"{r.loaded_chunks:>7} {len(r.wrong):>5} {r.max_logprob_diff:>11.2e}  {status}")
  lines.append(summary_line(results))
  return "\n".join(lines)


def summary_line(results: Sequence[CellResult]) -> str:
  n = sum(r.loadbacks for r in results)
  k = sum(len(r.wrong) for r in results)
  return f"{n} load-backs, {k} wrong"


def run_plan(plan: Plan, work_dir: str | None = None,
             on_cell: Callable[[CellResult], None] = lambda r: None) -> list[CellResult]:
  """Runs every cell of `plan` in `work_dir` (default: a fresh temporary folder)."""
  with contextlib.ExitStack() as stack:
    if work_dir is None:
      work_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvjax-loadback-"))
    return Matrix(plan, work_dir).run(on_cell)


def define_flags() -> dict[str, Any]:
  """The script's flags (defined only when it runs as a script: tests import this module beside
  other scripts whose flags share these names)."""
  return {
      "out": flags.DEFINE_string(
          "out", str(REPO / "benchmarks" / "results" / "loadback_matrix.json"), "Results JSON."),
      "quick": flags.DEFINE_bool("quick", False, "A slice: host and disk, raw and int8, fresh "
                                 "and restart, two prompts."),
      "tiers": flags.DEFINE_list("tiers", list(TIERS), "Tiers to run."),
      "codecs": flags.DEFINE_list("codecs", list(CODECS), "Codecs to run."),
      "events": flags.DEFINE_list("events", list(EVENTS), "Events to run."),
      "lengths": flags.DEFINE_list("lengths", [str(n) for n in EDGE_LENGTHS],
                                   "Prompt lengths, tokens (each at least C + 1 = 33)."),
      "seed": flags.DEFINE_integer("seed", 0, "Seed of the prompts' tokens and the churn "
                                   "orders."),
  }


_FLAGS: dict[str, Any] = {}


def main(argv):
  del argv
  f = {name: flag.value for name, flag in _FLAGS.items()}
  if f["quick"]:
    plan = dataclasses.replace(QUICK, seed=f["seed"])
  else:
    plan = Plan(tiers=tuple(f["tiers"]), codecs=tuple(f["codecs"]), events=tuple(f["events"]),
                lengths=tuple(int(n) for n in f["lengths"]), seed=f["seed"])
  if min(plan.lengths) <= C:
    raise app.UsageError(f"prompt lengths must be > C = {C} (one loadable chunk at least)")
  for name, got, known in (("tier", plan.tiers, TIERS), ("codec", plan.codecs, CODECS),
                           ("event", plan.events, EVENTS)):
    unknown = sorted(set(got) - set(known))
    if unknown:
      raise app.UsageError(f"unknown {name}s {unknown}; known: {list(known)}")
  record = {**benchlib.provenance(), "quick": f["quick"], "seed": plan.seed,
            "chunk_size": C, "block_size": BLOCK, "prompt_lengths": list(plan.lengths),
            "tiers": list(plan.tiers), "codecs": list(plan.codecs), "events": list(plan.events),
            "logprob_tolerance": LOGPROB_TOL, "max_tokens": PARAMS.max_tokens}
  t0 = time.perf_counter()
  results = run_plan(plan, on_cell=lambda r: print(
      f"{r.tier}/{r.codec}/{r.event}: {r.loadbacks} load-backs, {len(r.wrong)} wrong"
      + ("" if not r.error else f", FAILED: {r.error}"), flush=True))
  record.update({
      "seconds": time.perf_counter() - t0,
      "loadbacks": sum(r.loadbacks for r in results),
      "wrong": sum(len(r.wrong) for r in results),
      "failed_cells": [f"{r.tier}/{r.codec}/{r.event}: {r.error}" for r in results if r.error],
      "cells": [{**dataclasses.asdict(r), "ok": r.ok} for r in results]})
  benchlib.write_json(f["out"], record)
  print(table(results))
  failed = [r for r in results if not r.ok]
  if failed:
    sys.exit(1)


if __name__ == "__main__":
  _FLAGS.update(define_flags())
  app.run(main)
