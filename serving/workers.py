"""PDF pages rendered in a separate process, within limits: a hostile PDF (a few KB that draw a rectangle
10^12 times through nested forms) costs that process its memory and time, never the server's.

Two sides in one module:

- the worker, `python -m ocr_latent.serving.pdf_worker --memory-bytes N`: it caps its own address space
  (RLIMIT_AS) before it imports PDFium, then answers requests on stdin/stdout one at a time: `open` (a
  document; answers its page count), `render` (one page of it, as RGB bytes at a given longest side),
  `close`. It imports neither torch nor the rest of the package. It ends when its parent does.
- `PdfPool` in the caller: up to `workers` such processes, started lazily and kept. Every answer has
  `deadline_s` to come; a worker that misses it (or that a caller cancels, e.g. its client hung up) is
  killed and replaced on the next call. A worker that dies (over its memory limit PDFium aborts) likewise.

The pool knows nothing of page selection or HTTP: `serving.documents` says what to open and render and
turns `RenderError` into its `DocumentError`. Messages are frames: two big-endian uint32 lengths, a JSON
header of that length, then a payload of that length (the PDF's bytes, a page's RGB bytes).
"""
from __future__ import annotations

import json
import os
import queue
import select
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

FRAME = struct.Struct("!II")
MIB = 1 << 20
STARTUP_S = 60.0  # for a worker to start and import PDFium, on a busy machine


class RenderError(Exception):
    """The worker refused the document or page, or was over a limit: `status`, `type` and a message for the
    user (serving.documents makes it a DocumentError)."""

    def __init__(self, message: str, status: int = 422, type: str | None = None):
        super().__init__(message)
        self.status, self.type = status, type


class Cancelled(Exception):
    """The caller's cancel event was set while its worker rendered: the worker was killed."""


# ----------------------------------------------------------------------------- frames
def write_frame(stream, header: dict, payload: bytes = b"") -> None:
    head = json.dumps(header).encode()
    stream.write(FRAME.pack(len(head), len(payload)) + head)
    stream.write(payload)
    stream.flush()


def read_exact(stream, n: int) -> bytes | None:
    """n bytes from a blocking stream; None at end of file."""
    chunks, left = [], n
    while left:
        chunk = stream.read(left)
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_frame(stream) -> tuple[dict, bytes] | None:
    lengths = read_exact(stream, FRAME.size)
    if lengths is None:
        return None
    n_head, n_payload = FRAME.unpack(lengths)
    head, payload = read_exact(stream, n_head), read_exact(stream, n_payload) if n_payload else b""
    if head is None or payload is None:
        return None
    return json.loads(head), payload


# ----------------------------------------------------------------------------- the worker process
def limit_memory(memory_bytes: int) -> None:
    import resource
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a render that aborts leaves no core file


def watch_parent() -> None:
    """End this process when the one that started it is gone (even mid-render: ctypes releases the GIL)."""
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)
    threading.Thread(target=watch, daemon=True).start()


def render_page(pdf, index: int, size: int) -> tuple[dict, bytes]:
    count = len(pdf)
    try:
        page = pdf[index]
    except Exception:  # noqa: BLE001 - PdfiumError: /Count beyond the pages there are, a looping page tree
        raise RenderError(f"page {index + 1} of the PDF cannot be loaded: its page tree is damaged "
                          f"(it claims {count} pages)", 422) from None
    try:
        width, height = page.get_size()  # points, rotation applied
        if not (width > 0 and height > 0):
            raise RenderError(f"page {index + 1} has no area ({width}x{height} points)", 422)
        bitmap = page.render(scale=size / max(width, height), fill_color=(255, 255, 255, 255))
        try:
            image = bitmap.to_pil().convert("RGB")
        finally:
            bitmap.close()
    finally:
        page.close()
    return {"width": image.width, "height": image.height}, image.tobytes()


def open_pdf(data: bytes):
    import pypdfium2 as pdfium
    try:
        return pdfium.PdfDocument(data)
    except pdfium.PdfiumError as e:
        if "password" in str(e).lower():
            raise RenderError("the PDF is encrypted; send a decrypted copy", 422) from None
        raise RenderError(f"not a readable PDF: {e}", 415) from None


def serve(requests, answers) -> None:
    """Answer frames from `requests` on `answers` until end of file."""
    pdf = None
    while (frame := read_frame(requests)) is not None:
        header, payload = frame
        try:
            if header["op"] == "open":
                if pdf is not None:
                    pdf.close()
                    pdf = None
                pdf = open_pdf(payload)
                write_frame(answers, {"pages": len(pdf)})
            elif header["op"] == "render":
                meta, pixels = render_page(pdf, header["index"], header["size"])
                write_frame(answers, meta, pixels)
            elif header["op"] == "close":
                if pdf is not None:
                    pdf.close()
                    pdf = None
                write_frame(answers, {})
        except RenderError as e:
            write_frame(answers, {"error": {"status": e.status, "type": e.type, "message": str(e)}})
        except MemoryError:
            write_frame(answers, {"error": {"status": 413, "type": "document_too_complex",
                                            "message": "the PDF is too complex: rendering it needs more memory "
                                                       "than a render may use (PDF_MEMORY_BYTES)"}})
        except Exception as e:  # noqa: BLE001 - a page PDFium cannot render is the document's fault
            write_frame(answers, {"error": {"status": 422, "type": "invalid_document",
                                            "message": f"the PDF could not be rendered ({type(e).__name__})"}})


def main(argv: list[str]) -> None:
    import signal
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C on the server's terminal: the server ends us
    memory_bytes = int(argv[argv.index("--memory-bytes") + 1])
    limit_memory(memory_bytes)
    watch_parent()
    answers = os.fdopen(os.dup(1), "wb")  # frames only: whatever a library prints goes to stderr
    os.dup2(2, 1)
    import PIL.Image  # noqa: F401 - imported now, within the limit, not first under a render's memory pressure
    import pypdfium2  # noqa: F401
    write_frame(answers, {"ready": True})
    serve(sys.stdin.buffer, answers)


# ----------------------------------------------------------------------------- the caller's side
@dataclass
class Limits:
    workers: int = 2
    memory_bytes: int = 512 << 20
    deadline_s: float = 10.0


class Worker:
    """One worker process; `call` sends a frame and waits for the answer, within the deadline."""

    def __init__(self, limits: Limits):
        self.limits = limits
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ocr_latent.serving.pdf_worker", "--memory-bytes", str(limits.memory_bytes)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
        try:  # started and imported before the first deadline runs
            n_head, _ = FRAME.unpack(self._read(FRAME.size, time.monotonic() + STARTUP_S, None))
            self._read(n_head, time.monotonic() + STARTUP_S, None)
        except RenderError:
            self.kill()
            raise RenderError("the PDF renderer could not be started; try again", 503, "unavailable") from None

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            stream.close()

    def call(self, header: dict, payload: bytes = b"", cancel: threading.Event | None = None) -> tuple[dict, bytes]:
        try:
            write_frame(self.proc.stdin, header, payload)
        except (BrokenPipeError, OSError):
            raise self._died() from None
        deadline = time.monotonic() + self.limits.deadline_s
        lengths = self._read(FRAME.size, deadline, cancel)
        n_head, n_payload = FRAME.unpack(lengths)
        answer = json.loads(self._read(n_head, deadline, cancel))
        payload = self._read(n_payload, deadline, cancel) if n_payload else b""
        if "error" in answer:
            e = answer["error"]
            raise RenderError(e["message"], e["status"], e["type"])
        return answer, payload

    def _read(self, n: int, deadline: float, cancel: threading.Event | None) -> bytes:
        fd, chunks, left = self.proc.stdout.fileno(), [], n
        while left:
            if cancel is not None and cancel.is_set():
                self.kill()
                raise Cancelled()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.kill()
                raise RenderError(
                    f"the PDF is too complex: a page took longer than {self.limits.deadline_s:g} s to render "
                    f"(PDF_DEADLINE_S), so its rendering was stopped; send the page as an image instead, or a "
                    f"simpler PDF", 413, "document_too_complex")
            ready, _, _ = select.select([fd], [], [], min(0.1, remaining))
            if ready:
                chunk = os.read(fd, min(left, 1 << 20))
                if not chunk:
                    raise self._died()
                chunks.append(chunk)
                left -= len(chunk)
        return b"".join(chunks)

    def _died(self) -> RenderError:
        self.kill()
        return RenderError(
            f"the PDF is too complex: rendering it needed more than the {self.limits.memory_bytes // MIB} MiB a "
            f"render may use (PDF_MEMORY_BYTES), or it crashed the renderer, so it was stopped; send the page as "
            f"an image instead, or a simpler PDF", 413, "document_too_complex")


class PdfPool:
    """Up to `limits.workers` worker processes, each used by one caller at a time (`lease`)."""

    def __init__(self, limits: Limits):
        self.limits = limits
        self.idle: queue.Queue[Worker | None] = queue.Queue()
        for _ in range(limits.workers):
            self.idle.put(None)  # a slot whose worker starts when it is first needed

    def lease(self) -> "Lease":
        return Lease(self)

    def close(self) -> None:
        """Kill the idle workers (those leased end when their callers return them to a closed pool)."""
        while True:
            try:
                worker = self.idle.get_nowait()
            except queue.Empty:
                return
            if worker is not None:
                worker.kill()


class Lease:
    """`with pool.lease() as worker:` one live worker for the block; a killed one is replaced next time."""

    def __init__(self, pool: PdfPool):
        self.pool, self.worker = pool, None

    def __enter__(self) -> Worker:
        worker = self.pool.idle.get()
        if worker is None or not worker.alive:
            if worker is not None:
                worker.kill()
            try:
                worker = Worker(self.pool.limits)
            except BaseException:
                self.pool.idle.put(None)
                raise
        self.worker = worker
        return worker

    def __exit__(self, *exc) -> None:
        self.pool.idle.put(self.worker if self.worker.alive else None)


if __name__ == "__main__":
    main(sys.argv)
