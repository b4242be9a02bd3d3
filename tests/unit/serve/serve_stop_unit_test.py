"""A stopping server answers every request it accepted: the stop of `python -m kvjax.serve`
(`backend.engine.shutdown()`, then `HttpServer.stop()`), in-process on the fake runner.

The order of events is set by the server's own hook, never by sleeps: `HttpServer.draining`
(the listening socket is closed). The server process's SIGINT during streams (a running stream's
error event, queued requests' 503): tests/integration/serve/start_stop_test.py.
"""

import json
import socket
import threading

import httpx
from absl.testing import absltest

from kvjax.serve import HttpServer, ServeState, backend_from_llm, close_backend, create_app
from kvjax.testing import engines

SHUTTING_DOWN = "the server is shutting down"


def request_bytes(body: dict) -> tuple[bytes, bytes]:
  """A POST /v1/completions split in two: the request line and Host, then the rest."""
  data = json.dumps(body).encode()
  head = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
  rest = (b"Content-Type: application/json\r\nContent-Length: " + str(len(data)).encode()
          + b"\r\n\r\n" + data)
  return head, rest


def read_to_end(sock: socket.socket) -> bytes:
  """Everything the server sends until it closes the connection (b"" if it sent nothing)."""
  out = []
  try:
    while chunk := sock.recv(65536):
      out.append(chunk)
  except ConnectionResetError:
    pass
  return b"".join(out)


class ServeStopUnitTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.llm = engines.fake_llm(max_num_seqs=1, chunk_sizes=(16,))
    self.state = ServeState()
    self.http = HttpServer(create_app(self.state), "127.0.0.1", 0)
    self.http.start()
    self.backend = backend_from_llm(self.llm, warm=False)
    self.state.attach(self.backend)
    self.stopper = threading.Thread(target=self.stop)
    self.addCleanup(self.cleanup)

  def stop(self):
    # What `python -m kvjax.serve` does on SIGINT: fail what runs, then stop HTTP.
    self.backend.engine.shutdown()
    self.http.stop()

  def cleanup(self):
    if not self.stopper.is_alive() and self.stopper.ident is None:
      self.stopper.start()
    self.stopper.join(60)
    close_backend(self.backend, self.llm)

  def test_a_request_on_its_way_during_the_stop_gets_its_503(self):
    # Connection a is accepted before the stop (b, connected after it, was answered), but its
    # request head arrives only once the server stopped listening. uvicorn's own shutdown closed
    # such a connection at once: the client saw a dropped connection, not the 503 body.
    head, rest = request_bytes({"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2})
    a = socket.create_connection(("127.0.0.1", self.http.port), timeout=60)
    self.addCleanup(a.close)
    a.sendall(head)
    self.assertEqual(httpx.get(self.http.url + "/health", timeout=60).status_code, 200)
    self.stopper.start()
    self.assertTrue(self.http.draining.wait(60))
    with self.assertRaises(ConnectionRefusedError):  # no new connection is accepted
      socket.create_connection(("127.0.0.1", self.http.port), timeout=60).close()
    a.sendall(rest)
    reply = read_to_end(a)
    self.assertTrue(reply.startswith(b"HTTP/1.1 503 "), reply)
    body = json.loads(reply.split(b"\r\n\r\n", 1)[1])
    self.assertEqual(body["error"]["message"], SHUTTING_DOWN)
    self.stopper.join(60)
    self.assertFalse(self.stopper.is_alive())


if __name__ == "__main__":
  absltest.main()
