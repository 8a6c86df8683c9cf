"""Documents decoded in separate processes, within limits: a hostile PDF (a few KB that draw a rectangle
10^12 times through nested forms) or image (a 200 KB progressive JPEG that repeats its last scan 4,000
times) costs that process its memory and time, never the server's, and stops when its client leaves.

Two sides in one module:

- the worker, `python -m ocr_latent.serving.workers pdf|image --memory-bytes N`: it caps its own address
  space (RLIMIT_AS) before it imports PDFium or Pillow's decoders, then answers requests on stdin/stdout one
  at a time. A `pdf` worker: `open` (a document; answers its page count), `render` (one page of it, as RGB
  bytes at a given longest side), `close`. An `image` worker: `view` (an image file -> the encoder's view of
  it, RGB bytes; serving/images.py). It imports neither torch nor the web framework. It ends when its parent
  does.
- `WorkerPool` in the caller: up to `workers` such processes, started lazily and kept. Every answer has
  `deadline_s` to come, and a call may bring a deadline of its own (`until`: its request's); a worker that
  misses either (or that a caller cancels, e.g. its client hung up) is killed and replaced on the next
  call. A worker that dies (over its memory limit PDFium aborts) likewise.

The pool knows nothing of page selection or HTTP: `serving.documents` says what to open, render and view,
and turns `RenderError` into its `DocumentError`. Messages are frames: two big-endian uint32 lengths, a JSON
header of that length, then a payload of that length (the file's bytes, a page's RGB bytes).
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
    """The caller's cancel event was set while its worker worked: the worker was killed."""


class OutOfTime(Exception):
    """The caller's own deadline (`until`) passed while its worker worked, or before one was free: the
    worker, if it had started, was killed."""


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


def view_of(header: dict, data: bytes) -> tuple[dict, bytes]:
    """An image file -> the page, no larger than its view in `header["mode"]` (images.page_for_encoder), RGB
    bytes; DocumentError as RenderError."""
    from ocr_latent.serving.images import TRIM_FROM_BYTES, DocumentError, page_for_encoder, trim_memory
    try:
        view, held = page_for_encoder(data, header["max_pixels"], header["mode"])
    except DocumentError as e:
        raise RenderError(str(e), e.status, e.type) from None
    if held >= TRIM_FROM_BYTES:
        trim_memory()  # what a large page freed goes back to the system now, not at this worker's next decode
    return {"width": view.width, "height": view.height}, view.tobytes()


def serve(requests, answers, kind: str = "pdf") -> None:
    """Answer frames from `requests` on `answers` until end of file."""
    pdf = None
    while (frame := read_frame(requests)) is not None:
        header, payload = frame
        try:
            if kind == "image":
                if header["op"] != "view":
                    raise RenderError(f"an image worker does not {header['op']}", 422)
                meta, pixels = view_of(header, payload)
                write_frame(answers, meta, pixels)
            elif header["op"] == "open":
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
            write_frame(answers, {"error": {"status": 413, "type": TOO_COSTLY[kind],
                                            "message": MESSAGES[kind]["memory"]}})
        except Exception as e:  # noqa: BLE001 - a page PDFium cannot render is the document's fault
            what = "the PDF could not be rendered" if kind == "pdf" else "the image could not be decoded"
            write_frame(answers, {"error": {"status": 422 if kind == "pdf" else 415, "type": "invalid_document" if
                                            kind == "pdf" else "unsupported_media_type",
                                            "message": f"{what} ({type(e).__name__})"}})


def main(argv: list[str]) -> None:
    import signal
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C on the server's terminal: the server ends us
    kind = argv[1]
    memory_bytes = int(argv[argv.index("--memory-bytes") + 1])
    limit_memory(memory_bytes)
    watch_parent()
    answers = os.fdopen(os.dup(1), "wb")  # frames only: whatever a library prints goes to stderr
    os.dup2(2, 1)
    # imported now, within the limit, not first under a decode's memory pressure
    if kind == "pdf":
        import pypdfium2  # noqa: F401
    else:
        import ocr_latent.serving.images  # noqa: F401
        from PIL import Image
        Image.init()  # every decoder plugin, before the first file
    write_frame(answers, {"ready": True})
    serve(sys.stdin.buffer, answers, kind)


# ----------------------------------------------------------------------------- the caller's side
TOO_COSTLY = {"pdf": "document_too_complex", "image": "image_too_complex"}
MESSAGES = {
    "pdf": {"start": "the PDF renderer could not be started; try again",
            "deadline": "the PDF is too complex: a page took longer than {deadline:g} s to render (PDF_DEADLINE_S), so "
                        "its rendering was stopped; send the page as an image instead, or a simpler PDF",
            "memory": "the PDF is too complex: rendering it needs more memory than a render may use (PDF_MEMORY_BYTES)",
            "died": "the PDF is too complex: rendering it needed more than the {mib} MiB a render may use "
                    "(PDF_MEMORY_BYTES), or it crashed the renderer, so it was stopped; send the page as an image "
                    "instead, or a simpler PDF"},
    "image": {"start": "the image decoder could not be started; try again",
              "deadline": "the image is too costly to decode: it took longer than {deadline:g} s (IMAGE_DEADLINE_S), "
                          "so its decoding was stopped; send it as a baseline JPEG or a PNG",
              "memory": "the image is too large to decode within the memory a decode may use "
                        "(IMAGE_WORKER_MEMORY_BYTES)",
              "died": "the image is too costly to decode: it needed more than the {mib} MiB a decode may use "
                      "(IMAGE_WORKER_MEMORY_BYTES), or it crashed the decoder, so it was stopped; send it as a "
                      "baseline JPEG or a PNG"},
}


@dataclass
class Limits:
    workers: int = 2
    memory_bytes: int = 512 << 20
    deadline_s: float = 10.0  # for each answer
    kind: str = "pdf"  # pdf | image


class Worker:
    """One worker process; `call` sends a frame and waits for the answer, within the deadlines."""

    def __init__(self, limits: Limits):
        self.limits, self.messages = limits, MESSAGES[limits.kind]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ocr_latent.serving.workers", limits.kind, "--memory-bytes", str(limits.memory_bytes)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
        try:  # started and imported before the first deadline runs
            n_head, _ = FRAME.unpack(self._read(FRAME.size, time.monotonic() + STARTUP_S, None))
            self._read(n_head, time.monotonic() + STARTUP_S, None)
        except RenderError:
            self.kill()
            raise RenderError(self.messages["start"], 503, "unavailable") from None

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            stream.close()

    def call(self, header: dict, payload: bytes = b"", cancel: threading.Event | None = None,
             until: float | None = None) -> tuple[dict, bytes]:
        """The answer to one frame within `deadline_s` (else RenderError 413) and `until` (time.monotonic(),
        else OutOfTime); setting `cancel` stops it (Cancelled). A worker stopped so is killed."""
        try:
            write_frame(self.proc.stdin, header, payload)
        except (BrokenPipeError, OSError):
            raise self._died() from None
        deadline = time.monotonic() + self.limits.deadline_s
        lengths = self._read(FRAME.size, deadline, cancel, until)
        n_head, n_payload = FRAME.unpack(lengths)
        answer = json.loads(self._read(n_head, deadline, cancel, until))
        payload = self._read(n_payload, deadline, cancel, until) if n_payload else b""
        if "error" in answer:
            e = answer["error"]
            raise RenderError(e["message"], e["status"], e["type"])
        return answer, payload

    def _read(self, n: int, deadline: float, cancel: threading.Event | None, until: float | None = None) -> bytearray:
        fd, left = self.proc.stdout.fileno(), n
        buffer = bytearray(n)  # filled in place: a view of 3 MB is not held twice
        while left:
            if cancel is not None and cancel.is_set():
                self.kill()
                raise Cancelled()
            now = time.monotonic()
            if until is not None and now >= until and until < deadline:
                self.kill()
                raise OutOfTime()
            if now >= deadline:
                self.kill()
                raise RenderError(self.messages["deadline"].format(deadline=self.limits.deadline_s), 413,
                                  TOO_COSTLY[self.limits.kind])
            ready, _, _ = select.select([fd], [], [], max(0.0, min(0.1, min(deadline, until or deadline) - now)))
            if ready:
                got = os.readv(fd, [memoryview(buffer)[n - left:]])
                if not got:
                    raise self._died()
                left -= got
        return buffer

    def _died(self) -> RenderError:
        self.kill()
        return RenderError(self.messages["died"].format(mib=self.limits.memory_bytes // MIB), 413,
                           TOO_COSTLY[self.limits.kind])


class WorkerPool:
    """Up to `limits.workers` worker processes, each used by one caller at a time (`lease`)."""

    def __init__(self, limits: Limits):
        self.limits = limits
        self.idle: queue.Queue[Worker | None] = queue.Queue()
        for _ in range(limits.workers):
            self.idle.put(None)  # a slot whose worker starts when it is first needed

    def lease(self, cancel: threading.Event | None = None, until: float | None = None) -> "Lease":
        """`with pool.lease() as worker:` one live worker; waiting for one ends with Cancelled when `cancel` is
        set, with OutOfTime at `until`."""
        return Lease(self, cancel, until)

    def start(self) -> None:
        """Start the workers now (a server's first requests then find them ready)."""
        workers = [self.lease().__enter__() for _ in range(self.limits.workers)]
        for worker in workers:
            self.idle.put(worker)

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
    def __init__(self, pool: WorkerPool, cancel: threading.Event | None = None, until: float | None = None):
        self.pool, self.worker, self.cancel, self.until = pool, None, cancel, until

    def __enter__(self) -> Worker:
        worker = self._wait()
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

    def _wait(self) -> Worker | None:
        while True:
            if self.cancel is not None and self.cancel.is_set():
                raise Cancelled()
            if self.until is not None and time.monotonic() >= self.until:
                raise OutOfTime()
            try:
                return self.pool.idle.get(timeout=0.1)
            except queue.Empty:
                continue

    def __exit__(self, *exc) -> None:
        self.pool.idle.put(self.worker if self.worker.alive else None)


if __name__ == "__main__":
    main(sys.argv)
