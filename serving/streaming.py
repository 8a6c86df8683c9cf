"""Text pieces from the engine's thread to an asyncio consumer: the one adapter that both server.py's
streamed /decode and the Ray decode replicas use."""
from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator


class TextFeed:
    """`on_text` is the callback a decode job calls from the engine's thread; `follow(job)` yields the
    pieces on the event loop until the job is done, then the pieces queued before its result was set."""

    def __init__(self):
        self.loop, self.pieces = asyncio.get_running_loop(), asyncio.Queue()

    def on_text(self, piece: str) -> None:
        self.loop.call_soon_threadsafe(self.pieces.put_nowait, piece)

    async def follow(self, result: asyncio.Future, deadline: float | None = None) -> AsyncIterator[str]:
        """Pieces until `result` (the job's future, wrapped) is done; raises TimeoutError when `deadline`
        (time.monotonic()) passes first."""
        while not result.done():
            piece = asyncio.ensure_future(self.pieces.get())
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                done, _ = await asyncio.wait({piece, result}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            finally:
                if not piece.done():  # timed out, the job ended, or the client left while this waited
                    piece.cancel()
            if piece in done:
                yield piece.result()
            elif not done:
                raise TimeoutError()
        while not self.pieces.empty():  # the last pieces are queued before the result is set
            yield self.pieces.get_nowait()
