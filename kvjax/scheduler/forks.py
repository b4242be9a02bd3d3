"""Requests waiting to fork from a parent's prompt (`n` > 1): the scheduler's queue of them.

A request added with `fork_of` waits here until the plan that runs its parent's last prefill
chunk forks it (`Scheduler._fork_children`); a finished parent sends its children to the
ordinary waiting queue. Owned by the scheduler, which alone calls it (on its thread).
"""

from __future__ import annotations

from kvjax._typing import RequestId
from kvjax.scheduler.request import Request


class ForkQueue:
  """Children by parent, in arrival order, with each child's parent (an index of the same)."""

  def __init__(self):
    self._children: dict[RequestId, list[Request]] = {}
    self._parent: dict[RequestId, RequestId] = {}

  def __len__(self) -> int:
    """Children waiting."""
    return len(self._parent)

  def add(self, parent_id: RequestId, child: Request) -> None:
    self._children.setdefault(parent_id, []).append(child)
    self._parent[child.request_id] = parent_id

  def parent_of(self, child_id: RequestId) -> RequestId | None:
    """The parent a request waits to fork from, or None."""
    return self._parent.get(child_id)

  def pop_children(self, parent_id: RequestId) -> list[Request]:
    """The parent's waiting children, in arrival order, no longer waiting."""
    children = self._children.pop(parent_id, [])
    for c in children:
      del self._parent[c.request_id]
    return children

  def remove(self, child_id: RequestId) -> Request | None:
    """Takes one waiting child out (aborted), or None when it is not waiting."""
    parent_id = self._parent.pop(child_id, None)
    if parent_id is None:
      return None
    children = self._children[parent_id]
    child = next(c for c in children if c.request_id == child_id)
    children.remove(child)
    if not children:
      del self._children[parent_id]
    return child
