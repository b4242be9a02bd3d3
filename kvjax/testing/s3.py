"""A local S3 for tests: moto's server on a thread of this process, with S3's atomic writes.

moto (5.x) checks a conditional PUT's precondition (`If-None-Match: *`, `If-Match`) and then
writes the object with nothing held between the two, so on its threaded server two racing
create-if-absent PUTs of one key can both succeed. S3 itself makes each conditional write
atomic, and kvjax's publish protocol relies on that (`kvjax/storage/backends/chunk_store.py`). The
server here answers one request at a time (a WSGI wrapper holding a lock over the whole
request, body included), so moto keeps S3's contract and a test that races publishers tests
kvjax rather than the fake. Connections are still accepted concurrently.

moto and werkzeug come with the `[test]` extra; they are imported when a server starts.
"""

from __future__ import annotations

import threading


class MotoServer:
  """moto's S3 server bound to 127.0.0.1 on a port the OS picks, one request at a time.

  `start()` returns once the socket is listening (nothing polls or sleeps); `endpoint` is then
  its `http://host:port`. `stop()` shuts it down and joins its thread.
  """

  def __init__(self):
    self.endpoint = ""
    self._server = None
    self._thread: threading.Thread | None = None

  def start(self) -> None:
    from moto.server import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server

    app = DomainDispatcherApplication(create_backend_app)
    lock = threading.Lock()

    def one_at_a_time(environ, start_response):
      with lock:
        return list(app(environ, start_response))

    self._server = make_server("127.0.0.1", 0, one_at_a_time, threaded=True)
    host, port = self._server.server_address[:2]
    self.endpoint = f"http://{host}:{port}"
    self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
    self._thread.start()

  def stop(self) -> None:
    if self._server is not None:
      self._server.shutdown()
      self._thread.join()
      self._server = None
