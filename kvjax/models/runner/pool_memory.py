"""Device memory sizing of the paged pool: how many blocks it gets (docs/design/paged-memory.md).

On CPU the pool is host memory, sized to what the sequences can use (at most 2 GiB); on an
accelerator it is what the compiled step leaves of the device's memory: the largest step bucket is
compiled ahead of time at two pool sizes (an abstract runner: nothing allocated), its peak fitted
linearly in the pool size and held under the device's memory (`fit_num_blocks`).
`build_paged_runner` applies that default to build a `PagedModelRunner`.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from flax import nnx

from kvjax.kernels.platform import platform_of
from kvjax.models.nn.kv_cache import PoolLayout, paged_block_nbytes
from kvjax.models.nn.llama import Llama
from kvjax.models.runner.paged_runner import PagedModelRunner, pool_layout
from kvjax.models.runner.runner_api import PagedRunnerConfig
from kvjax.models.runner.sharding import TensorParallel

#: Default pool size on CPU, bytes; accelerators size it from the compiled step
#: (`fit_num_blocks`).
DEFAULT_CPU_KV_CACHE_BYTES = 2 << 30
#: Fraction of an accelerator's free memory the pool takes by default when the device reports
#: its memory but the step's needs cannot be measured (vLLM's `gpu_memory_utilization`).
DEFAULT_ACCELERATOR_MEMORY_FRACTION = 0.8
#: Share of an accelerator's memory the default pool size leaves unused beyond what the compiled
#: step needs (allocator fragmentation, host transfers, programs other than the step).
DEFAULT_ACCELERATOR_MEMORY_MARGIN = 0.05
#: Pool sizes (blocks) of the two step compiles `fit_num_blocks` measures (multiples of 128, so
#: the block axis never changes the pool's tiled layout between them).
PROBE_NUM_BLOCKS = (128, 256)


def default_kv_cache_bytes(cpu_need_bytes: int | None = None) -> int:
  """The pool size when none is given, bytes: on CPU `min(2 GiB, cpu_need_bytes)`, else 80% of
  the device's free memory.

  `cpu_need_bytes` is what every sequence at full length needs (`build_paged_runner`:
  `max_num_seqs` x `max_model_len`): on CPU the pool is host memory that each `LLM` zero-fills
  at construction, so a small configuration (the tiny test model, a short `max_model_len`) gets
  no more than its sequences can use, and a process with several
  engines (the test suite) is not charged 2 GiB each. Falls back to the CPU default when the
  device reports no memory statistics.
  """
  if jax.default_backend() == "cpu":
    if cpu_need_bytes is not None:
      return min(DEFAULT_CPU_KV_CACHE_BYTES, cpu_need_bytes)
    return DEFAULT_CPU_KV_CACHE_BYTES
  stats = jax.devices()[0].memory_stats() or {}
  limit, used = stats.get("bytes_limit"), stats.get("bytes_in_use", 0)
  if not limit:
    return DEFAULT_CPU_KV_CACHE_BYTES
  return int((limit - used) * DEFAULT_ACCELERATOR_MEMORY_FRACTION)


@dataclasses.dataclass(frozen=True)
class ProgramMemory:
  """A compiled program's memory, bytes per device (XLA's `memory_analysis()`), at a pool of
  `num_blocks` blocks.

  Attributes:
    num_blocks: the pool's blocks in the program measured.
    argument_bytes, output_bytes, alias_bytes, temp_bytes, generated_code_bytes: as XLA
      reports them (alias: outputs sharing a donated argument's buffer).
  """

  num_blocks: int
  argument_bytes: int
  output_bytes: int
  alias_bytes: int
  temp_bytes: int
  generated_code_bytes: int = 0

  @property
  def peak_bytes(self) -> int:
    """Live at once: arguments, outputs not aliased to a donated argument, temporaries, code."""
    return (self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes
            + self.generated_code_bytes)

  @classmethod
  def of(cls, compiled, num_blocks: int) -> "ProgramMemory":
    """From a `jax.stages.Compiled`.

    Raises:
      ValueError: the backend reports no memory analysis.
    """
    ma = compiled.memory_analysis()
    if ma is None:
      raise ValueError("this backend reports no memory analysis")
    return cls(num_blocks, int(ma.argument_size_in_bytes), int(ma.output_size_in_bytes),
               int(ma.alias_size_in_bytes), int(ma.temp_size_in_bytes),
               int(ma.generated_code_size_in_bytes))


def pool_blocks_for_memory(device_bytes: int, small: ProgramMemory, large: ProgramMemory, *,
                           in_use_bytes: int = 0,
                           margin: float = DEFAULT_ACCELERATOR_MEMORY_MARGIN) -> int:
  """The most pool blocks with which the step fits a device, from the step compiled at two
  pool sizes: its peak is `fixed + per_block * num_blocks` (weights, activations, code; the
  pool and whatever scales with it), fitted through the two measurements, and must stay under
  `device_bytes * (1 - margin) - in_use_bytes`.

  Args:
    device_bytes: the device's memory (per device: every figure is per device).
    small, large: the step's memory at two pool sizes (`large.num_blocks > small.num_blocks`).
    in_use_bytes: memory the step's arguments do not account for (other buffers, other
      programs' weights).
    margin: share of `device_bytes` left unused.

  Raises:
    ValueError: bad probes, or not even one block fits.
  """
  if large.num_blocks <= small.num_blocks:
    raise ValueError(f"probes at {small.num_blocks} and {large.num_blocks} blocks: want two "
                     "sizes, the second larger")
  per_block = (large.peak_bytes - small.peak_bytes) / (large.num_blocks - small.num_blocks)
  if per_block <= 0:
    raise ValueError(f"the step's memory does not grow with the pool ({small.peak_bytes} bytes "
                     f"at {small.num_blocks} blocks, {large.peak_bytes} at {large.num_blocks})")
  fixed = small.peak_bytes - per_block * small.num_blocks
  budget = device_bytes * (1.0 - margin) - in_use_bytes - fixed
  blocks = int(budget // per_block)
  if blocks < 1:
    raise ValueError(f"the step needs {fixed / 2**30:.2f} GiB besides the pool and "
                     f"{per_block / 2**20:.2f} MiB per block; the device has "
                     f"{device_bytes / 2**30:.2f} GiB ({in_use_bytes / 2**30:.2f} GiB in use, "
                     f"{margin:.0%} margin): no room for a pool")
  return blocks


def blocks_for_bytes(model_config, block_size: int, nbytes: int, dtype,
                     layout: PoolLayout | None = None) -> int:
  """Pool blocks that fit in `nbytes` (K and V of every layer, in `layout`: its padding
  counts), at least 1."""
  return max(1, int(nbytes) // paged_block_nbytes(model_config, block_size, dtype, layout))


def measure_step_memory(model: Llama, config: PagedRunnerConfig,
                        tensor_parallel: TensorParallel | None = None, *, device=None,
                        num_blocks: int) -> ProgramMemory:
  """The largest step bucket's memory on the runner's devices with a pool of `num_blocks`
  blocks: compiled ahead of time (an abstract runner: nothing allocated), per device.

  Raises:
    ValueError: the backend reports no memory analysis; what compiling raises.
  """
  runner = PagedModelRunner(model, dataclasses.replace(config, num_blocks=num_blocks),
                            tensor_parallel, device=device, abstract=True)
  name, fn, args = runner.aot_programs(buckets=(runner.buckets[-1],), codecs=())[0]
  assert name.startswith("step"), name
  mesh = jax.sharding.Mesh(np.asarray(runner.devices), ("tp",))
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):  # the kernels see the target chip
    lowered = fn.lower(*args)
  return ProgramMemory.of(lowered.compile(), num_blocks)


def fit_num_blocks(model: Llama, config: PagedRunnerConfig,
                   tensor_parallel: TensorParallel | None = None, *, device=None,
                   device_bytes: int, in_use_bytes: int = 0,
                   margin: float = DEFAULT_ACCELERATOR_MEMORY_MARGIN) -> int:
  """The default pool size on an accelerator, in blocks: the largest step bucket compiled at
  `PROBE_NUM_BLOCKS` pool sizes (`measure_step_memory`), its peak fitted linearly in the pool
  size and held under the device's memory (`pool_blocks_for_memory`). What the compiled step
  really needs (weights, activations, the pool in its tiled layout, anything XLA copies), so
  the runner's step fits the chip it targets.

  Raises:
    ValueError: as `pool_blocks_for_memory` and `measure_step_memory`.
  """
  small, large = (measure_step_memory(model, config, tensor_parallel, device=device,
                                      num_blocks=n) for n in PROBE_NUM_BLOCKS)
  return pool_blocks_for_memory(device_bytes, small, large, in_use_bytes=in_use_bytes,
                                margin=margin)


def _state_nbytes(model: Llama) -> int:
  return sum(int(x.nbytes) for x in jax.tree_util.tree_leaves(nnx.state(model))
             if hasattr(x, "nbytes"))


def build_paged_runner(model: Llama, *, block_size: int, kv_cache_memory_bytes: int | None,
                       max_num_seqs: int, max_num_batched_tokens: int,
                       max_seq_len: int | None, chunk_sizes: tuple[int, ...],
                       tensor_parallel: TensorParallel | None = None) -> PagedModelRunner:
  """A `PagedModelRunner` whose pool fills `kv_cache_memory_bytes` in the model's dtype
  (`bytes // block bytes` blocks in the pool's layout, at least one). Default: on CPU
  `default_kv_cache_bytes(max_num_seqs x max_seq_len tokens)`; on an accelerator what the
  compiled step leaves of the device's memory (`fit_num_blocks`), or 80% of its free memory
  when it reports no memory analysis. A request that can never fit is refused at admission.

  Raises:
    ValueError: a non-positive size.
  """
  for name, v in (("block_size", block_size), ("kv_cache_memory_bytes", kv_cache_memory_bytes)):
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
      raise ValueError(f"{name}={v!r} must be a positive int")
  config = PagedRunnerConfig(
      num_blocks=1, block_size=block_size, max_num_seqs=max_num_seqs,
      max_num_batched_tokens=max_num_batched_tokens, max_seq_len=max_seq_len,
      chunk_sizes=tuple(chunk_sizes))
  devices = (list(tensor_parallel.mesh.devices.flat) if tensor_parallel is not None
             else [jax.devices()[0]])
  platform = platform_of(devices)
  layout = pool_layout(model.cfg, tensor_parallel, platform)
  nbytes, num_blocks = kv_cache_memory_bytes, None
  if nbytes is None and platform != "cpu":
    stats = devices[0].memory_stats() or {}
    if stats.get("bytes_limit"):
      # The weights already on the device are the step's arguments (counted in its peak).
      other = max(0, stats.get("bytes_in_use", 0) - _state_nbytes(model))
      try:
        num_blocks = fit_num_blocks(model, config, tensor_parallel, device=devices[0],
                                    device_bytes=int(stats["bytes_limit"]),
                                    in_use_bytes=other)
      except ValueError:
        num_blocks = None  # no memory analysis here: a share of free memory instead
  if num_blocks is None:
    if nbytes is None:
      seq_blocks = -(-(max_seq_len or model.cfg.max_seq_len) // block_size)
      nbytes = default_kv_cache_bytes(
          max_num_seqs * seq_blocks * paged_block_nbytes(model.cfg, block_size, model.dtype,
                                                         layout))
    num_blocks = blocks_for_bytes(model.cfg, block_size, nbytes, model.dtype, layout)
  return PagedModelRunner(model, dataclasses.replace(config, num_blocks=num_blocks),
                          tensor_parallel)
