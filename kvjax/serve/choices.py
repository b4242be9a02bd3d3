"""`n` > 1 on both endpoints: one prompt computed once, forked into n choices.

    submit(choice 0)  ──> engine request `id`              (its prefill computes the prompt)
    submit(choice i, fork_of=id) ──> `id`-i, i = 1..n-1    (forked at choice 0's last prefill
                                                            chunk: `Engine.add_request(fork_of=)`)
    n output queues ──> one merged queue of (index, output) ──> one body with n choices, or one
                                                                 SSE stream interleaving them

Choice i is sampled with `choice_seed(seed, i)`, so identical requests get identical choices,
and at temperature 0 all n are equal. Each choice has its own `index`, `finish_reason` and
logprobs; a stream sends each choice's role chunk, text deltas and finish chunk with its index,
in the order the engine produces them. Usage counts the prompt once and the completion tokens of
every choice. The bodies and chunks are `Generation`'s, re-indexed, so whatever a choice of one
carries, a choice of n carries too. A disconnect or fault aborts every choice.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from starlette.responses import JSONResponse, Response

from kvjax.engine import RequestOutput
from kvjax.scheduler.request import choice_params
from kvjax.serve import protocol, tool_calls
from kvjax.serve.completions import Generation, _EventStream, _sse
from kvjax.serve.detokenizer import IncrementalDetokenizer
from kvjax.serve.protocol import ApiError


class ForkedGeneration(Generation):
  """A request with `n` > 1 choices (no session: the protocol refuses `n` > 1 with one)."""

  def _ids(self) -> list[str]:
    return [self.id] + [f"{self.id}-{i}" for i in range(1, self.params.n)]

  def _abort_unfinished(self, done: set[int]) -> None:
    """Aborts the choices not in `done` (finished or aborted already) and adds them to it."""
    for i, rid in enumerate(self._ids()):
      if i not in done:
        self.b.engine.abort(rid)
        done.add(i)

  async def run(self) -> Response:
    n, ids = self.params.n, self._ids()
    queues = []
    try:
      for i, rid in enumerate(ids):
        queues.append(self.b.engine.submit(rid, self.prompt_ids, choice_params(self.params, i),
                                           self.req.cache_salt,
                                           fork_of=self.id if i else None))
    except BaseException:  # e.g. 429 for a later choice: none of them runs
      self._abort_unfinished(set())
      raise
    merged: asyncio.Queue = asyncio.Queue()
    pumps = [asyncio.ensure_future(_pump(i, q, merged)) for i, q in enumerate(queues)]
    done: set[int] = set()

    def end() -> None:  # every ending: unfinished choices aborted, no pump left waiting
      self._abort_unfinished(done)
      for p in pumps:
        p.cancel()

    streaming = False
    try:
      first = await self._first_of(merged, done)
      if first is None:
        return Response(status_code=499)
      if self.req.stream:
        streaming = True
        return _EventStream(self._stream_n(merged, first, done), on_close=end,
                            media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
      outs: dict[int, RequestOutput] = {}
      self._note(first, outs, done)
      gone = asyncio.ensure_future(self._disconnected())
      try:
        while len(done) < n:
          get = asyncio.ensure_future(merged.get())
          finished, _ = await asyncio.wait({gone, get}, return_when=asyncio.FIRST_COMPLETED)
          if get not in finished:
            get.cancel()
            return Response(status_code=499)
          self._note(self._unpack(get.result()), outs, done)
      finally:
        gone.cancel()
      self.b.count(self.endpoint, outs[0].finish_reason)  # one request
      return JSONResponse(self._body_n([outs[i] for i in range(n)]))
    finally:
      if not streaming:
        end()

  def _unpack(self, item) -> tuple[int, RequestOutput]:
    i, got = item
    return i, self._take(got)

  @staticmethod
  def _note(item: tuple[int, RequestOutput], outs: dict, done: set[int]) -> None:
    i, out = item
    outs[i] = out
    if out.finished:
      done.add(i)

  async def _first_of(self, merged: asyncio.Queue, done: set[int]
                      ) -> tuple[int, RequestOutput] | None:
    """The first output of any choice, or None if the client left first."""
    gone = asyncio.ensure_future(self._disconnected())
    get = asyncio.ensure_future(merged.get())
    try:
      finished, _ = await asyncio.wait({gone, get}, return_when=asyncio.FIRST_COMPLETED)
    finally:
      gone.cancel()
    if get not in finished:
      get.cancel()
      return None
    return self._unpack(get.result())

  # -- bodies -------------------------------------------------------------------------------
  def _usage_n(self, outs: list[RequestOutput]) -> dict:
    return protocol.usage(len(self.prompt_ids), sum(len(o.token_ids) for o in outs),
                          outs[0].num_cached_tokens)

  def _body_n(self, outs: list[RequestOutput]) -> dict:
    body = self._body(outs[0])
    body["choices"] = [_indexed(self._body(o)["choices"][0], i) for i, o in enumerate(outs)]
    body["usage"] = self._usage_n(outs)
    return body

  def _chunk_i(self, i: int, text, lp, finish, *, role: bool = False,
               calls: list | None = None) -> dict:
    chunk = self._chunk(text, lp, finish, role=role, calls=calls)
    chunk["choices"] = [_indexed(c, i) for c in chunk["choices"]]
    return chunk

  async def _stream_n(self, merged: asyncio.Queue, first: tuple[int, RequestOutput],
                      done: set[int]) -> AsyncIterator[str]:
    """SSE events of n choices: per choice (chat: a role chunk), its text deltas and finish
    chunk, interleaved as they come; then (usage) and the `kvjax` object, [DONE]."""
    n = self.params.n
    detoks = [IncrementalDetokenizer(self.b.tokenizer, self.params.stop) for _ in range(n)]
    names = self._tool_names()  # each choice's reply is read for tool calls on its own
    streams = [tool_calls.CallStream(names, self.req.parallel_tool_calls is not False)
               if names is not None else None for _ in range(n)]
    sent = [0] * n
    started: set[int] = set()
    outs: dict[int, RequestOutput] = {}
    item = first
    failed = False
    try:
      while True:
        i, out = item
        outs[i] = out
        if self.chat and i not in started:
          started.add(i)
          yield _sse(self._chunk_i(i, None, None, None, role=True))
        text = detoks[i].finish(out.text) if out.finished else detoks[i].update(out.token_ids)
        new_ids = out.token_ids[sent[i]:]
        lp = self._logprobs(new_ids, out.logprobs[sent[i]:]) if out.logprobs else None
        sent[i] = len(out.token_ids)
        if out.finished:
          done.add(i)
          found = []
          if streams[i] is not None:
            text, found = streams[i].finish(text)
          yield _sse(self._chunk_i(i, text, lp, self._finish_reason(out, bool(found)),
                                   calls=found))
        else:
          if streams[i] is not None:
            text = streams[i].update(text)
          if text or lp:
            yield _sse(self._chunk_i(i, text, lp, None))
        if len(done) == n:
          break
        try:
          item = self._unpack(await merged.get())
        except ApiError as e:
          yield _sse(e.body())
          failed = True
          break
      if not failed:
        ordered = [outs[k] for k in range(n)]
        last = {**self._chunk(None, None, None), "choices": []}
        if self._include_usage:
          last["usage"] = self._usage_n(ordered)
        last["kvjax"] = self._extension(ordered[0])
        yield _sse(last)
      self.b.count(self.endpoint, outs[0].finish_reason if 0 in done else "error")
      yield "data: [DONE]\n\n"
    finally:
      self._abort_unfinished(done)  # the client left (the stream's `on_close` does it too)


def _indexed(choice: dict, index: int) -> dict:
  return {**choice, "index": index}


async def _pump(index: int, queue: asyncio.Queue, merged: asyncio.Queue) -> None:
  """Forwards one choice's outputs to the merged queue as (index, item) until its last."""
  while True:
    item = await queue.get()
    merged.put_nowait((index, item))
    if not isinstance(item, tuple) or item[0].finished:
      return
