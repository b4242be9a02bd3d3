"""Multi-host as one program: process 0's device calls reach every process.

Under `jax.distributed` every process must issue the same jit calls over the global mesh, in the
same order, with the same host inputs. kvjax's scheduler and engine run on process 0 only (the
plan is computed once, from the one request queue the HTTP server feeds); the paged runner on
process 0 sends each device call's opcode and host arrays (token ids, positions, slot mapping,
block tables, a loaded chunk) to every process before running it, and the runner on every other
process receives them (`PagedModelRunner.follow`) and runs the same call. The transport is JAX's
own collective (`multihost_utils.broadcast_one_to_all`: a psum over every device, gloo on CPU),
so there is no separate RPC for the model.

    process 0:  plan -> host arrays -> send(op, arrays) -> jit call   -> outputs (replicated)
    process i:                         receive()        -> jit call   -> (discarded)

A message is two broadcasts: an int32 header (opcode, then dtype code, rank and dims of each
array), then the arrays themselves, whose shapes every receiver now knows.
"""

from __future__ import annotations

from typing import Sequence

import jax
import ml_dtypes
import numpy as np
from jax.experimental import multihost_utils

HEADER_LEN = 64
MAX_ARRAYS = 8
_DIMS = 5
_DTYPES = (np.dtype(np.int32), np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16),
           np.dtype(np.float16))

# Opcodes of the paged runner's device calls.
STEP, INSERT, READ, RESET, CLOSE, COPY = 1, 2, 3, 4, 5, 6


def _header(op: int, arrays: Sequence[np.ndarray]) -> np.ndarray:
  if len(arrays) > MAX_ARRAYS:
    raise ValueError(f"{len(arrays)} arrays in one message; at most {MAX_ARRAYS}")
  h = np.zeros(HEADER_LEN, np.int32)
  h[0], h[1] = op, len(arrays)
  for i, a in enumerate(arrays):
    if a.dtype not in _DTYPES or a.ndim > _DIMS:
      raise ValueError(f"array {i}: {a.dtype}{list(a.shape)} cannot be sent (dtypes "
                       f"{[d.name for d in _DTYPES]}, rank <= {_DIMS})")
    base = 2 + i * (2 + _DIMS)
    h[base], h[base + 1] = _DTYPES.index(a.dtype), a.ndim
    h[base + 2:base + 2 + a.ndim] = a.shape
  return h


class Channel:
  """Process 0 -> every process: an opcode and host arrays, through JAX collectives.

  Every process must call `send` (process 0) or `receive` (the others) the same number of times.
  """

  def __init__(self):
    self.is_leader = jax.process_index() == 0

  def send(self, op: int, *arrays) -> tuple[np.ndarray, ...]:
    """Process 0: sends `op` and `arrays`; returns them as contiguous numpy arrays."""
    assert self.is_leader, "only process 0 sends"
    arrays = tuple(np.ascontiguousarray(np.asarray(a)) for a in arrays)
    multihost_utils.broadcast_one_to_all(_header(op, arrays))
    if arrays:
      multihost_utils.broadcast_one_to_all(arrays)
    return arrays

  def receive(self) -> tuple[int, tuple[np.ndarray, ...]]:
    """Every other process: the next (opcode, arrays) process 0 sent."""
    assert not self.is_leader, "process 0 sends"
    h = np.asarray(multihost_utils.broadcast_one_to_all(np.zeros(HEADER_LEN, np.int32)))
    op, n = int(h[0]), int(h[1])
    zeros = []
    for i in range(n):
      base = 2 + i * (2 + _DIMS)
      dtype, ndim = _DTYPES[int(h[base])], int(h[base + 1])
      zeros.append(np.zeros(tuple(int(d) for d in h[base + 2:base + 2 + ndim]), dtype))
    if not zeros:
      return op, ()
    got = multihost_utils.broadcast_one_to_all(tuple(zeros))
    return op, tuple(np.asarray(a) for a in got)
