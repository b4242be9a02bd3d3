"""Tensor parallelism over a device mesh: the `tp` axis, parameter and pool shardings.

Megatron-LM's layout (Shoeybi et al. 2019, section 3) on a 1-D `jax.sharding.Mesh` with one
named axis, `tp`, over the first N devices. GSPMD (`jax.jit` with `NamedSharding`s) partitions
the step; the attention kernel runs per shard under `shard_map` (each shard attends with its own
query heads over its own KV heads, no communication).

    parameter                     shape            sharded over tp
    layers.wq                     [L, D, N, H]     N (query heads: columns)
    layers.wk, layers.wv          [L, D, K, H]     K when K % tp == 0, else replicated
    layers.bq (Qwen2)             [L, N, H]        N
    layers.bk, layers.bv (Qwen2)  [L, K, H]        as layers.wk
    layers.wo                     [L, N, H, D]     N (rows: one all-reduce after attention)
    layers.w_gate, layers.w_up    [L, D, F]        F (columns)
    layers.w_down                 [L, F, D]        F (rows: one all-reduce after the MLP)
    embed, lm_head, norms, RoPE   -                replicated (Qwen3's q_norm, k_norm [L, H] too)

The paged pool `[L, P, B, K', H]` is sharded over its head axis K'. K' = K when K % tp == 0 (each
device holds K / tp KV heads); when tp > K (tp % K == 0, e.g. LLaMA's 8 KV heads at tp = 16) each
KV head is repeated r = tp / K times, K' = tp, and each device holds the one KV head its query
heads read, as vLLM does. Query head j reads pool head j // (N / K'), whose KV head is
(j // (N / K')) // r = j // (N / K): a copy of its own, so attention sums what one device sums.

Valid sizes (vLLM's rule): tp divides N, tp divides F, and K % tp == 0 or tp % K == 0.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from kvjax.models.nn.config import LlamaConfig

#: The mesh axis tensor parallelism shards over.
TP_AXIS = "tp"


def check_tensor_parallel_size(cfg: LlamaConfig, size: Any, num_devices: int | None = None
                               ) -> None:
  """Checks that `size` devices can split `cfg` Megatron-style.

  Raises:
    ValueError: `size` not a positive int, a head / MLP count it does not divide (vLLM's rule:
      `size` divides the query heads and the MLP width, and the KV heads are a multiple of
      `size` or `size` a multiple of them), or more than the devices there are (checked last).
  """
  if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
    raise ValueError(f"tensor_parallel_size={size!r} must be a positive int")
  n, k, f = cfg.n_heads, cfg.n_kv_heads, cfg.mlp_dim
  if n % size:
    raise ValueError(f"tensor_parallel_size={size} does not divide {cfg.name}'s {n} attention "
                     "heads")
  if k % size and size % k:
    raise ValueError(f"tensor_parallel_size={size} and {cfg.name}'s {k} KV heads: one must "
                     "divide the other")
  if f % size:
    raise ValueError(f"tensor_parallel_size={size} does not divide {cfg.name}'s MLP width {f}")
  # After the shape rules, so the device advice is only given for a size the model accepts.
  if num_devices is None:
    num_devices = jax.device_count()
  if size > num_devices:
    raise ValueError(f"tensor_parallel_size={size} needs {size} devices; {num_devices} "
                     f"{jax.default_backend()} device(s) are visible (on CPU, set "
                     f"XLA_FLAGS=--xla_force_host_platform_device_count={size} before jax starts)")


@dataclasses.dataclass(frozen=True)
class TensorParallel:
  """A `tp` mesh and what it implies for one model.

  Attributes:
    mesh: the 1-D mesh, axis `TP_AXIS`, over the first `size` devices.
    size: devices in the mesh (N of `tensor_parallel_size`).
    kv_head_repeat: r, copies of each KV head in the pool (1 unless size > K).
    kv_split: whether wk / wv (and the step's pre-RoPE K / V outputs) are split over tp.
  """

  mesh: Mesh
  size: int
  kv_head_repeat: int
  kv_split: bool

  @classmethod
  def build(cls, cfg: LlamaConfig, size: int, devices=None) -> "TensorParallel":
    """The mesh over `devices` (default the first `size` of `jax.devices()`).

    Raises:
      ValueError: as `check_tensor_parallel_size`.
    """
    devices = list(jax.devices() if devices is None else devices)
    check_tensor_parallel_size(cfg, size, len(devices))
    k = cfg.n_kv_heads
    return cls(mesh=Mesh(np.asarray(devices[:size]), (TP_AXIS,)), size=size,
               kv_head_repeat=max(1, size // k), kv_split=k % size == 0)

  # ----------------------------------------------------------------------------- specs
  def sharding(self, spec: P) -> NamedSharding:
    return NamedSharding(self.mesh, spec)

  @property
  def replicated(self) -> NamedSharding:
    return self.sharding(P())

  @property
  def pool_sharding(self) -> NamedSharding:
    """The pool's K and V `[L, P, B, K' * H]`, by head (each device a contiguous run of whole
    heads of the folded last axis)."""
    return self.sharding(P(None, None, None, TP_AXIS))

  @property
  def chunk_sharding(self) -> NamedSharding:
    """A chunk in pool head order, `[L, 2, C, K', H]`: each device gets its heads only."""
    return self.sharding(P(None, None, None, TP_AXIS, None))

  @property
  def kv_out_sharding(self) -> NamedSharding:
    """The step's pre-RoPE K and V `[L, T, K, H]`: split by head when wk / wv are, replicated
    otherwise or across processes (process 0 saves them, so it must hold them whole)."""
    if self.kv_split and jax.process_count() == 1:
      return self.sharding(P(None, None, TP_AXIS, None))
    return self.replicated

  def param_spec(self, name: str) -> P:
    """The PartitionSpec of a canonical parameter (`kvjax.models.nn.llama.param_shapes` names)."""
    t = TP_AXIS
    specs = {
        "layers.wq": P(None, None, t, None),
        "layers.bq": P(None, t, None),
        "layers.wo": P(None, t, None, None),
        "layers.w_gate": P(None, None, t),
        "layers.w_up": P(None, None, t),
        "layers.w_down": P(None, t, None),
    }
    if self.kv_split:
      specs["layers.wk"] = specs["layers.wv"] = P(None, None, t, None)
      specs["layers.bk"] = specs["layers.bv"] = P(None, t, None)
    return specs.get(name, P())

  def state_shardings(self, state):
    """NamedShardings for an `nnx.split` state of `Llama` (same tree)."""
    def one(path, _):
      keys = [getattr(k, "key", None) for k in path]
      name = ".".join(str(k) for k in keys if isinstance(k, str))
      return self.sharding(self.param_spec(name))
    return jax.tree_util.tree_map_with_path(one, state)


def put(x, sharding: NamedSharding) -> jax.Array:
  """Places a host (or single-device) array with `sharding`: each device receives its own
  slice only; works across processes (every process passes the same value)."""
  host = np.asarray(x)
  return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def initialize_distributed(coordinator_address: str | None, num_processes: int | None,
                           process_id: int | None) -> bool:
  """`jax.distributed.initialize` for a multi-host run (every process runs the same program).

  On CPU, collectives go through gloo. A no-op (False) when `num_processes` is None or 1.

  Raises:
    ValueError: an incomplete or out-of-range set of options.
  """
  if num_processes is None or num_processes == 1:
    return False
  if isinstance(num_processes, bool) or not isinstance(num_processes, int) or num_processes < 1:
    raise ValueError(f"num_processes={num_processes!r} must be a positive int")
  if not coordinator_address:
    raise ValueError("num_processes > 1 needs coordinator_address (host:port of process 0)")
  if isinstance(process_id, bool) or not isinstance(process_id, int) or not (
      0 <= process_id < num_processes):
    raise ValueError(f"process_id={process_id!r} must be an int in [0, {num_processes})")
  if jax.distributed.is_initialized():
    return True
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=coordinator_address,
                             num_processes=num_processes, process_id=process_id)
  return True
