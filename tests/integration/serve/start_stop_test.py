"""`python -m kvjax.serve` stops cleanly on SIGINT/SIGTERM at every moment of its life.

Each case starts the server as a process, reads its log until the line of one start-up step
appears (the loader's own progress lines: weights, compile k/N, ready), signals it there, and
checks the exit: code 0 (or 130 for a forced second signal), a stop line, and none of the
aborts seen before (a daemon loader thread inside XLA at interpreter exit: "terminate called",
"Fatal Python error", exit 134; or a Ctrl-C swallowed by JAX's gc callback).
"""

import os
import pathlib
import queue
import signal
import subprocess
import sys
import threading
import time
from unittest import mock

import httpx
import pytest
from absl.testing import absltest

from kvjax.models.loading import gguf_loader

REPO = pathlib.Path(__file__).resolve().parents[3]
TINY = ["--model=tiny", "--port=0", "--cache_dir=", "--chunk_sizes=16,32", "--max_num_seqs=1"]
ABORTS = ("Fatal Python error", "terminate called", "Traceback", "Exception ignored")


def engine_requests(url: str, want: int, timeout_s: float = 120.0) -> int:
  """Requests the engine holds (waiting + running, from /metrics), polled until `want` or
  `timeout_s`; returns the last count read."""
  deadline, held, idle = time.monotonic() + timeout_s, -1, threading.Event()
  while held != want and time.monotonic() < deadline:
    text = httpx.get(url + "/metrics", timeout=30).text
    held = sum(int(float(line.split()[-1])) for line in text.splitlines()
               if line.startswith(("kvjax_num_requests_waiting ", "kvjax_num_requests_running ")))
    idle.wait(0.02)  # a poll interval, not a timing assumption: the loop ends on the count
  return held


class Server:
  """A server process whose stdout lines arrive on a queue (a reader thread), so waiting for a
  line has a timeout; stderr goes to a file (it cannot fill a pipe)."""

  def __init__(self, test: absltest.TestCase, *flags: str, env: dict | None = None):
    self.err = open(test.create_tempfile().full_path, "w+")
    env = {**os.environ, **(env or {}),
           "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    self.proc = subprocess.Popen([sys.executable, "-m", "kvjax.serve", *flags], cwd=REPO,
                                 env=env, stdout=subprocess.PIPE, stderr=self.err, text=True)
    self.lines: list[str] = []
    self._queue: queue.Queue = queue.Queue()
    self._reader = threading.Thread(target=self._read, daemon=True)
    self._reader.start()
    test.addCleanup(self.kill)

  def _read(self):
    for line in self.proc.stdout:
      self._queue.put(line.rstrip("\n"))
    self._queue.put(None)

  def wait_for(self, prefix: str, timeout_s: float = 300.0) -> str:
    """The first stdout line starting with `prefix`; AssertionError if the process ends first."""
    while True:
      line = self._queue.get(timeout=timeout_s)
      if line is None:
        raise AssertionError(f"the server ended before {prefix!r}: {self.output()}")
      self.lines.append(line)
      if line.startswith(prefix):
        return line

  def stop(self, sig: int = signal.SIGINT, timeout_s: float = 60.0) -> int:
    self.proc.send_signal(sig)
    code = self.proc.wait(timeout_s)
    self._reader.join(timeout_s)
    while not self._queue.empty():
      line = self._queue.get()
      if line is not None:
        self.lines.append(line)
    return code

  def output(self) -> str:
    self.err.seek(0)
    return "\n".join(self.lines) + "\n--- stderr ---\n" + self.err.read()

  def kill(self):
    if self.proc.poll() is None:
      self.proc.kill()
      self.proc.wait()


class StartStopTest(absltest.TestCase):

  def assert_clean_exit(self, server: Server, code: int, codes=(0,)):
    out = server.output()
    self.assertIn(code, codes, out)
    for abort in ABORTS:
      self.assertNotIn(abort, out)

  def test_sigint_while_loading_weights(self):
    server = Server(self, *TINY, "--kv_store=none")
    server.wait_for("kvjax: loading tiny weights")
    code = server.stop(signal.SIGINT)
    self.assert_clean_exit(server, code)
    self.assertIn("kvjax: stopping", server.output())
    self.assertNotIn("kvjax: ready", server.output())

  def test_sigterm_while_compiling(self):
    server = Server(self, *TINY, "--kv_store=memory://", "--kv_chunk_size=16")
    self.assertIn("KV store: 1 tier: disk memory://", server.wait_for("kvjax: KV store:"))
    self.assertRegex(server.wait_for("kvjax: compiling"), r"compiling \d+ programs")
    server.wait_for("kvjax: compiled 1/")
    code = server.stop(signal.SIGTERM)
    self.assert_clean_exit(server, code)
    self.assertIn("kvjax: stopping: cancelling the start-up", server.output())
    self.assertNotIn("kvjax: ready", server.output())

  # The serving stage with a store and its pending saves: the streams' SIGINT case below and
  # serve_main_test's port-0 case (SIGINT; SIGTERM: at compiling above). A server process: slow.
  @pytest.mark.slow
  def test_sigterm_while_serving_writes_pending_saves(self):
    server = Server(self, *TINY, "--kv_store=memory://", "--kv_chunk_size=16")
    url = server.wait_for("kvjax: ready").split(" at ")[-1]
    r = httpx.post(url + "/v1/completions", timeout=60,
                   json={"model": "tiny", "prompt": list(range(40)), "max_tokens": 2})
    self.assertEqual(r.json()["usage"]["completion_tokens"], 2)
    code = server.stop(signal.SIGTERM)
    self.assert_clean_exit(server, code)
    self.assertIn("kvjax: stopping (writing pending KV saves)", server.output())

  @pytest.mark.slow  # 12 s of decoding; SIGINT after a request: serve_main_test.py
  def test_sigint_during_streams_ends_them_with_an_error_event(self):
    # Twelve streams of 500 tokens, one running at a time (--max_num_seqs=1): about 6 s of
    # decoding for the tiny model, longer than uvicorn's 5 s graceful shutdown, which used to
    # cancel the open responses (a dropped connection, "Exception in ASGI application").
    # With a store: the stop also writes the streams' pending KV saves.
    server = Server(self, *TINY, "--kv_store=memory://", "--kv_chunk_size=16")
    url = server.wait_for("kvjax: ready").split(" at ")[-1]
    streams, first = [[] for _ in range(12)], threading.Event()

    def read_stream(lines):
      body = {"model": "tiny", "prompt": list(range(8)), "max_tokens": 500, "stream": True,
              "ignore_eos": True}
      with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
          if line:
            lines.append(line)
            first.set()

    readers = [threading.Thread(target=read_stream, args=(lines,)) for lines in streams]
    for t in readers:
      t.start()
    self.assertTrue(first.wait(120))
    # Signal only once the engine holds all twelve (what this test is about: queued requests).
    # A request on a connection the server accepted before the stop is answered too (503:
    # tests/unit/serve/serve_stop_unit_test.py); one that connects after it stopped listening
    # is refused, the client's to retry.
    self.assertEqual(engine_requests(url, want=12), 12)
    code = server.stop(signal.SIGINT)
    for t in readers:
      t.join(120)
    self.assert_clean_exit(server, code)
    self.assertNotIn("Exception in ASGI application", server.output())
    self.assertIn("kvjax: stopping (writing pending KV saves)", server.output())
    self.assertIn("kvjax: stopped", server.output())
    # Every request got an answer: a stream ended as streams do ([DONE], after an error event
    # when unfinished), a request whose stream had not begun a 503 body; none was cut off.
    for lines in streams:
      if lines[-1] == "data: [DONE]":
        continue
      self.assertEqual(len(lines), 1, lines)
      self.assertIn("the server is shutting down", lines[0])
    self.assertTrue(any("shutting down" in line for lines in streams for line in lines))

  def test_a_second_signal_exits_at_once(self):
    # The handler itself, deterministically: signals sent to the process itself are handled
    # before the next line runs (a second one during a stop exits with 130).
    code = ("import os, signal\n"
            "from kvjax.serve.__main__ import StopRequest\n"
            "stop = StopRequest(); stop.install()\n"
            "os.kill(os.getpid(), signal.SIGINT)\n"
            "print('first', stop.requested, flush=True)\n"
            "os.kill(os.getpid(), signal.SIGINT)\n"
            "print('not reached', flush=True)\n")
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    self.assertEqual(proc.returncode, 130, proc.stderr)
    self.assertEqual(proc.stdout, "first True\n")
    self.assertIn("kvjax: second signal: exiting now", proc.stderr)

  @pytest.mark.slow  # a server process (~10 s); the handler's second signal is tested above
  def test_two_signals_while_compiling(self):
    server = Server(self, *TINY, "--kv_store=none")
    server.wait_for("kvjax: compiled 1/")
    server.proc.send_signal(signal.SIGINT)
    server.wait_for("kvjax: stopping")
    code = server.stop(signal.SIGINT)  # the second: at once (130), unless the first won (0)
    self.assert_clean_exit(server, code, codes=(0, 130))

  # The real model, on kvjax's default cache root as the other real-model tests (a cold cache
  # converts and compiles on the first run: minutes on a busy 2-core VM; then ~15-40 s a start).
  @pytest.mark.slow
  def test_real_model_stops_at_every_step(self):
    try:
      gguf_loader.find_smollm2_gguf()
    except FileNotFoundError as e:
      self.skipTest(str(e))
    flags = ("--port=0", "--kv_store=memory://", "--kv_chunk_size=32", "--chunk_sizes=16,32",
             "--max_num_seqs=2", "--max_model_len=1024")
    for step, sig in (("kvjax: loading SmolLM2", signal.SIGINT),
                      ("kvjax: compiled 2/", signal.SIGTERM),
                      ("kvjax: ready", signal.SIGINT)):
      with self.subTest(step=step):
        server = Server(self, *flags)
        server.wait_for(step, timeout_s=900)
        code = server.stop(sig)
        self.assert_clean_exit(server, code)
        self.assertIn("kvjax: stopping", server.output())


if __name__ == "__main__":
  absltest.main()


class StartupEventsTest(absltest.TestCase):
  """`LLM(startup_progress=...)`, in-process: the steps the server logs, and cancellation."""

  def test_events_of_a_start_up_with_a_store(self):
    from kvjax.testing.engines import real_llm  # noqa: PLC0415
    events = []
    llm = real_llm("tiny", cache_dir="", chunk_sizes=(16, 32), max_num_seqs=2,
                   kv_store="memory://", kv_chunk_size=16,
                   compile_on_init=True, startup_progress=events.append)
    llm.close()
    phases = [e.phase for e in events]
    self.assertEqual(phases, ["weights", "weights", "cache", "cache", "store"]
                     + ["compile"] * 6 + ["ready"])
    compiles = [e for e in events if e.phase == "compile"]
    # The step at each token bucket (8, 16, 32), the stored chunk's insert, a session tail's
    # read-back: 5 programs.
    self.assertEqual([(e.done, e.total) for e in compiles], [(i, 5) for i in range(6)])
    self.assertEqual([e.message.split(": ", 1)[1].split(" (")[0] for e in compiles[1:]],
                     ["step of 8 tokens", "step of 16 tokens", "step of 32 tokens",
                      "insert of a stored 16-token chunk", "read-back of a session tail"])
    self.assertIn("KV cache: ", events[3].message)
    self.assertIn("blocks of 16 tokens", events[3].message)
    self.assertEqual(events[4].message, "KV store: 1 tier: disk memory:// (4 GiB); codec raw "
                     "levels [0]")

  def test_a_raising_callback_cancels_and_closes(self):
    from kvjax import LLM  # noqa: PLC0415
    from kvjax.testing.engines import real_llm  # noqa: PLC0415

    class Cancel(Exception):
      pass

    seen = []

    def progress(event):
      seen.append(event)
      if event.phase == "compile" and event.done == 1:
        raise Cancel()

    with mock.patch.object(LLM, "close", autospec=True, side_effect=LLM.close) as close:
      with self.assertRaises(Cancel):
        # test_events_of_a_start_up_with_a_store's options: the two share compiled programs.
        real_llm("tiny", cache_dir="", chunk_sizes=(16, 32), max_num_seqs=2,
                 kv_store="memory://", kv_chunk_size=16, compile_on_init=True,
                 startup_progress=progress)
    close.assert_called_once()
    self.assertEqual((seen[-1].phase, seen[-1].done), ("compile", 1))
