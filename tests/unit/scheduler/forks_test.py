"""The scheduler's queue of requests waiting to fork from a parent's prompt
(`kvjax/scheduler/forks.py`), alone."""

from absl.testing import absltest

from kvjax.scheduler.forks import ForkQueue
from kvjax.scheduler.request import Request, SamplingParams


def request(rid: str) -> Request:
  return Request(rid, [1, 2, 3], SamplingParams(max_tokens=4))


class ForkQueueTest(absltest.TestCase):

  def test_children_wait_by_parent_and_leave_once(self):
    q = ForkQueue()
    a1, a2, b1 = request("a1"), request("a2"), request("b1")
    q.add("a", a1)
    q.add("b", b1)
    q.add("a", a2)
    self.assertLen(q, 3)
    self.assertEqual((q.parent_of("a2"), q.parent_of("b1"), q.parent_of("a")), ("a", "b", None))
    self.assertIs(q.remove("a1"), a1)
    self.assertIsNone(q.remove("a1"))
    self.assertEqual(q.pop_children("a"), [a2])
    self.assertEqual((q.pop_children("a"), q.parent_of("a2"), len(q)), ([], None, 1))
    self.assertIs(q.remove("b1"), b1)
    self.assertFalse(q)


if __name__ == "__main__":
  absltest.main()
