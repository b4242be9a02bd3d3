"""The connector's host -> device link: staged chunks moved layer group by layer group on one
transfer thread, each piece charged to the emulated link first."""

from __future__ import annotations

import queue
import threading
from typing import Any, Sequence

import numpy as np

from kvjax.connector.device import DeviceSeam


class LayerTransfer:
  """One staged chunk moving host -> device layer group by layer group (layer-wise
  pre-loading, CachedAttention arXiv 2403.19708, section 3.2.1), on `HostToDevice`'s transfer
  thread, each group's bytes charged to the host -> device link (`KVStoreClient(device_link=)`)
  before it is put on the device.

  Attributes:
    groups: the layer ranges `(l0, l1)`, in transfer order.
  """

  def __init__(self, groups: Sequence[tuple[int, int]]):
    self.groups = tuple(groups)
    self._arrays: list[Any] = [None] * len(self.groups)
    self._error: BaseException | None = None
    self._cond = threading.Condition()

  def _set(self, g: int, array: Any = None, error: BaseException | None = None) -> None:
    with self._cond:
      if error is not None:
        self._error = error
      else:
        self._arrays[g] = array
      self._cond.notify_all()

  def wait(self, g: int, timeout_s: float | None = None):
    """Blocks until layer group `g` is on the device; returns it, `[l1 - l0, 2, C, K, H]`.

    Raises:
      RuntimeError: its transfer failed, or `timeout_s` passed.
    """
    with self._cond:
      if not self._cond.wait_for(lambda: self._arrays[g] is not None or self._error is not None,
                                 timeout_s):
        raise RuntimeError(f"layer group {g} of a chunk did not reach the device in {timeout_s} s")
      if self._error is not None:
        raise RuntimeError(f"moving a chunk to the device failed: {self._error!r}")
      return self._arrays[g]


class HostToDevice:
  """The host -> device link of staged chunks: one transfer thread ("kvjax-host-to-device",
  started on first use), every piece charged to the emulated link first.

  Owns: the transfer queue and thread. Called from the engine thread (`transfer`,
  `charge_device`, `close`); the transfer thread puts pieces through the device seam.

  Args:
    device: the runner's device seam (`put`).
    device_link: the emulated host -> device link (a `kvjax.storage.backends.link.LinkLimiter`), or
      None: no pacing.
  """

  def __init__(self, device: DeviceSeam, device_link=None):
    self._device = device
    self.device_link = device_link
    self._transfers: queue.Queue = queue.Queue()
    self._thread: threading.Thread | None = None

  def transfer(self, chunks: Sequence[np.ndarray], groups: Sequence[tuple[int, int]]
               ) -> list[LayerTransfer]:
    """Starts moving staged raw chunks to the device in layer groups, group-major (group 0 of
    every chunk, then group 1, ...), on one transfer thread (the link is one pipe). Every piece
    is booked on `device_link` (when set) now, back to back in that order, as copies queued on
    a copy engine are (`LinkLimiter.reserve`): the thread puts a piece on the device once its
    booked time has passed, and its own pauses between pieces never idle the link. Never
    blocks.

    Args:
      chunks: `[L, 2, C, K, H]` host arrays (a `ChunkHit.kv`).
      groups: layer ranges `(l0, l1)` tiling the chunks' layers, in order.

    Returns:
      One `LayerTransfer` per chunk, in order.
    """
    if self._thread is None:
      self._thread = threading.Thread(target=self._transfer_loop, name="kvjax-host-to-device",
                                      daemon=True)
      self._thread.start()
    out = [LayerTransfer(groups) for _ in chunks]
    link = self.device_link
    for g, (l0, l1) in enumerate(groups):
      for t, kv in zip(out, chunks):
        piece = kv[l0:l1]
        self._transfers.put((t, g, piece, None if link is None else link.reserve(piece.nbytes)))
    return out

  def charge_device(self, nbytes: int) -> None:
    """Charges `nbytes` to the host -> device link (blocking), when one is set: a chunk
    inserted whole pays its transfer before the insertion."""
    if self.device_link is not None:
      self.device_link.acquire_blocking(int(nbytes))

  def _transfer_loop(self) -> None:
    while True:
      job = self._transfers.get()
      if job is None:
        return
      t, g, piece, done_s = job
      try:
        if done_s is not None:
          self.device_link.wait_reserved(done_s, int(piece.nbytes))
        # Not waited for here: on a CPU backend the copy would queue behind the step's compute
        # and pace the emulated link by the engine (an accelerator's copy engine does not).
        t._set(g, self._device.put(piece))
      except Exception as e:  # noqa: BLE001 - reported to the waiter
        t._set(g, error=e)

  def close(self) -> None:
    """Finishes the queued pieces, then stops the transfer thread (if it started)."""
    if self._thread is not None:
      self._transfers.put(None)
      self._thread.join()
