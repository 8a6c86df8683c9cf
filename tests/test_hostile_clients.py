"""Hostile clients and expensive files (issue 52): what a client that never finishes its body, a JPEG that decodes
for half a minute, PDFs that take seconds a page, requests that hold every decode slot, many connections from
one address, requests framed two ways, streams left mid-way, keys a header cannot carry and bodies of the wrong
type cost the server. Each
test starts a server with the settings it needs and checks a bound the server must keep; bench/hostile_load.py
(phases A, B, D, E) measures the same at full size.

    ./test.sh tests/test_hostile_clients.py        # ~2 min once the server keeps the bounds
"""
import concurrent.futures
import http.client
import json
import os
import selectors
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from conftest import ROOT, Server, assert_error, metric, serving
from ocr_latent.client.codesfile import MEDIA_TYPE, CodesFile
from ocr_latent.examples.hostile import scan_bomb, slow_pdf

pytestmark = pytest.mark.slow  # each starts a server (~10 s) and runs for 10-30 s

ATTACKER = "127.0.0.2"  # Linux routes all of 127/8 to loopback: the attack comes from another client address


# ----------------------------------------------------------------------------- watching the server
def tree(pid: int) -> list[int]:
    """pid and every process under it (PDF and image workers)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                todo.extend(int(c) for c in (task / "children").read_text().split())
            except OSError:
                continue
    return out


def cpu_s(pid: int) -> float:
    """utime + stime of pid and its descendants, seconds."""
    ticks = 0
    for p in tree(pid):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


class HealthPoll(threading.Thread):
    """GET /health every 0.5 s, each on a new connection from 127.0.0.1: (seconds, status; 0 = no answer)."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.stop, self.answers = url, threading.Event(), []

    def run(self) -> None:
        while not self.stop.is_set():
            sent = time.monotonic()
            try:
                with httpx.Client(timeout=10) as c:
                    status = c.get(self.url + "/health").status_code
            except httpx.HTTPError:
                status = 0
            self.answers.append((round(time.monotonic() - sent, 2), status))
            self.stop.wait(max(0.0, 0.5 - (time.monotonic() - sent)))

    def __enter__(self) -> "HealthPoll":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.join()


def host_port(url: str) -> tuple[str, int]:
    host, _, port = url.removeprefix("http://").partition(":")
    return host, int(port)


# ----------------------------------------------------------------------------- A: bodies that never come
def test_connections_that_never_finish_their_bodies_are_cut(tmp_path):
    body_timeout_s, n = 3, 50
    with serving(tmp_path, "slow-bodies", BODY_TIMEOUT_S=body_timeout_s) as srv, HealthPoll(srv.url) as health:
        host, port = host_port(srv.url)
        head = (f"POST /encode HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: image/png\r\n"
                f"Content-Length: 100000\r\n\r\n").encode()
        sel, sent = selectors.DefaultSelector(), {}
        for _ in range(n):
            s = socket.socket()
            s.bind((ATTACKER, 0))
            s.settimeout(5)
            s.connect((host, port))
            s.sendall(head)
            sent[s] = time.monotonic()
            s.sendall(b"\x89PNG\r\n\x1a\n\0\0")  # 10 of the 100,000 bytes, then silence
            s.setblocking(False)
            sel.register(s, selectors.EVENT_READ)
        closed = {}
        until = time.monotonic() + body_timeout_s + 10
        try:
            while len(closed) < n and time.monotonic() < until:
                for key, _ in sel.select(timeout=0.25):
                    try:
                        if key.fileobj.recv(65536):
                            continue  # an answer (e.g. a 408) before the close
                    except BlockingIOError:
                        continue
                    except OSError:
                        pass  # reset: cut as well
                    closed[key.fileobj] = time.monotonic() - sent[key.fileobj]
                    sel.unregister(key.fileobj)
        finally:
            for s in sent:
                s.close()
            sel.close()
        late = sorted(round(t, 1) for t in closed.values() if t > body_timeout_s + 5)
        print(f"{len(closed)}/{n} cut, at {min(closed.values(), default=0):.1f}-{max(closed.values(), default=0):.1f} s "
              f"after their heads; /health: {len(health.answers)} polls, max {max(s for s, _ in health.answers):.2f} s")
        assert len(closed) == n and not late, (
            f"{n - len(closed)} of {n} connections still open {body_timeout_s + 10} s after their heads "
            f"(BODY_TIMEOUT_S={body_timeout_s}); cut late: {late}")
    bad = [(s, status) for s, status in health.answers if status != 200 or s >= 3]
    assert health.answers and not bad, f"/health while the connections hung: {bad}"


# ----------------------------------------------------------------------------- B: a JPEG of 3,800 scans
def test_a_scan_bomb_stops_costing_cpu_when_its_clients_leave(tmp_path):
    bomb = scan_bomb()
    assert 200_000 < len(bomb) < 220_000
    with serving(tmp_path, "scan-bombs") as srv:
        def hang_up_after_5s():
            started = time.monotonic()
            try:
                with httpx.Client(timeout=5.0) as c:
                    return c.post(srv.url + "/encode", content=bomb, headers={"Content-Type": "image/jpeg"}).status_code
            except httpx.TimeoutException:
                return f"hung up after {time.monotonic() - started:.1f} s"

        def decode():
            started = time.monotonic()
            try:
                with httpx.Client(timeout=20.0) as c:
                    r = c.post(srv.url + "/decode", json={"codes": [0] * 4096, "max_tokens": 8})
                return r.status_code, time.monotonic() - started
            except httpx.TimeoutException:
                return 0, time.monotonic() - started

        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            bombs = [pool.submit(hang_up_after_5s) for _ in range(2)]
            time.sleep(1.0)
            decoded = pool.submit(decode)
            outcomes = [f.result() for f in bombs]
            before = cpu_s(srv.proc.pid)
            time.sleep(10.0)
            used = cpu_s(srv.proc.pid) - before
            status, took = decoded.result()
        print(f"bombs: {outcomes}; /decode meanwhile: {status} in {took:.2f} s; server CPU in the 10 s after "
              f"the clients left: {used:.1f} s")
        assert status == 200 and took <= 10, f"/decode while 2 scan bombs decoded: {status} after {took:.1f} s"
        assert used <= 5.0, f"the server spent {used:.1f} s of CPU in the 10 s after the bombs' clients left"


# ----------------------------------------------------------------------------- D: PDFs that render slowly
def test_slow_pdfs_are_answered_within_the_request_timeout(tmp_path):
    # 4 pages of 6 draws, ~4.5 s a page here (under PDF_DEADLINE_S), one PDF worker: the second PDF waits
    # behind the first (~18 s) and then renders its own, ~35 s in all. (With two workers, or slow_pdf's ~3 s
    # pages, both finish within 25 s on this 2-core box even with no request deadline: 13.5 s and 24.1 s.)
    slow = slow_pdf(4, draws=6)
    with serving(tmp_path, "slow-pdfs", REQUEST_TIMEOUT_S=15, PDF_WORKERS=1) as srv:
        def send():
            started = time.monotonic()
            try:
                with httpx.Client(timeout=40.0) as c:
                    r = c.post(srv.url + "/encode", content=slow, headers={"Content-Type": "application/pdf"})
                return r.status_code, r.headers.get("retry-after"), time.monotonic() - started
            except httpx.TimeoutException:
                return 0, None, time.monotonic() - started

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            replies = list(pool.map(lambda _: send(), range(2)))
        print("replies (status, Retry-After, s):", [(s, ra, round(t, 1)) for s, ra, t in replies])
        assert all(status and took <= 25 for status, _, took in replies), f"REQUEST_TIMEOUT_S=15: {replies}"
        assert all(s < 500 or s == 504 or s == 503 and ra for s, ra, _ in replies), replies


# ----------------------------------------------------------------------------- E: every slot held
class Hog(threading.Thread):
    """A POST of a codes file on its own connection; `hang_up` closes it (the server should cancel its jobs)."""

    def __init__(self, url: str, path: str, body: bytes):
        super().__init__(daemon=True)
        self.conn = http.client.HTTPConnection(*host_port(url), timeout=300)
        self.path, self.body, self.status = path, body, None

    def run(self) -> None:
        try:
            self.conn.request("POST", self.path, body=self.body, headers={"Content-Type": MEDIA_TYPE})
            self.status = self.conn.getresponse().status
        except (OSError, http.client.HTTPException):
            self.status = "hung up"

    def hang_up(self) -> None:
        if self.conn.sock is not None:
            try:
                self.conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.join(10)
        self.conn.close()


def test_a_decode_is_answered_while_two_files_hold_every_slot(tmp_path):
    with serving(tmp_path, "slot-hogs", DECODE_SLOTS=4, OCR_LATENT_TEST_STEP_DELAY_S=0.05) as srv:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            r = c.post("/encode", content=(ROOT / "examples" / "page.png").read_bytes(),
                       headers={"Content-Type": "image/png"})
            assert r.status_code == 200, r.text
            page = r.json()
            params = c.get("/openapi.json").json()["paths"]["/decode"]["post"]["parameters"]
            most = next(p for p in params if p["name"] == "max_tokens")["schema"]["anyOf"][0]["maximum"]
        doc = CodesFile(page["quantizer"], page["mode"], [np.asarray(page["codes"], dtype=np.uint8)] * 32).to_bytes()
        hogs = [Hog(srv.url, f"/decode?ignore_eos=true&max_tokens={most}", doc) for _ in range(2)]
        for h in hogs:
            h.start()
        try:
            time.sleep(2.0)
            assert all(h.status != 422 for h in hogs), f"max_tokens={most} refused"
            started = time.monotonic()
            try:
                with httpx.Client(timeout=15.0) as c:
                    r = c.post(srv.url + "/decode", json={"codes": [0] * 4096, "max_tokens": 8})
                status, retry_after = r.status_code, r.headers.get("retry-after")
            except httpx.TimeoutException:
                status, retry_after = 0, None
            took = time.monotonic() - started
        finally:
            for h in hogs:
                h.hang_up()
        print(f"2 files of 32 pages x {most} tokens (ignore_eos): {[h.status for h in hogs]}; a lone /decode: "
              f"{status} in {took:.2f} s")
        assert took <= 10 and (status == 200 or status == 503 and retry_after), (
            f"a lone /decode behind two hogging files: {status or 'no answer'} after {took:.1f} s")


# ----------------------------------------------------------------------------- framing, connections, keys
NUM_CODES = 4096
PER_CLIENT = 8


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serving(tmp_path_factory.mktemp("clients"), "clients", BODY_TIMEOUT_S=2,
                 MAX_CONNECTIONS_PER_CLIENT=PER_CLIENT, OCR_LATENT_TEST_STEP_DELAY_S=0.02) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def connect(server, source: str = "127.0.0.1") -> socket.socket:
    """A raw connection from `source` (any 127/8 address is this machine's loopback: another client address)."""
    s = socket.socket()
    s.bind((source, 0))
    s.connect(("127.0.0.1", server.port))
    s.settimeout(10)
    return s


def read_all(s: socket.socket) -> bytes:
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


def test_connections_beyond_the_per_client_cap_are_refused_and_others_are_served(server, client):
    before = metric(client, "ocr_latent_connections_closed_total", reason="per_client")
    held = [connect(server, "127.0.0.2") for _ in range(PER_CLIENT)]
    try:
        time.sleep(0.2)
        probe = connect(server, "127.0.0.2")  # a probe from the busy address is still answered
        probe.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert read_all(probe).startswith(b"HTTP/1.1 200")
        extra = connect(server, "127.0.0.2")
        extra.sendall(b"POST /decode HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
        answer = read_all(extra)  # answered and closed
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in head.lower(), answer
        assert "MAX_CONNECTIONS_PER_CLIENT" in json.loads(body)["error"]["message"]
        assert client.get("/health").status_code == 200  # another address is served meanwhile
    finally:
        for s in held:
            s.close()
    assert metric(client, "ocr_latent_connections_closed_total", reason="per_client") == before + 1
    time.sleep(0.2)
    again = connect(server, "127.0.0.2")  # the address's connections were counted down as they closed
    again.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert read_all(again).startswith(b"HTTP/1.1 200")


def test_a_body_that_stops_gets_a_408_and_its_connection_closed(server, client):
    before = metric(client, "ocr_latent_requests_total", endpoint="/encode", status="408")
    s = connect(server)
    s.sendall(b"POST /encode HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\nContent-Length: 100000\r\n\r\n0123456789")
    started = time.monotonic()
    answer = read_all(s)
    assert 1.5 < time.monotonic() - started < 5, "not cut at BODY_TIMEOUT_S (2 s)"
    assert answer.startswith(b"HTTP/1.1 408") and b"BODY_TIMEOUT_S" in answer, answer
    assert metric(client, "ocr_latent_requests_total", endpoint="/encode", status="408") == before + 1
    assert metric(client, "ocr_latent_connections_closed_total", reason="body_timeout") >= 1


def test_content_length_with_transfer_encoding_is_refused_and_the_connection_closed(server):
    s = connect(server)
    s.sendall(b"POST /decode HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 5\r\n"
              b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\nGET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    answer = read_all(s)  # ends: the server closed the connection rather than read on
    assert answer.startswith(b"HTTP/1.1 400") and b"Transfer-Encoding" in answer, answer
    assert answer.count(b"HTTP/1.1") == 1  # the request smuggled behind it was not answered


def test_a_body_neither_file_nor_json_is_refused_naming_its_type(client):
    err = assert_error(client.post("/encode", content=b"hello, world", headers={"Content-Type": "text/plain"}), 415)
    assert err["type"] == "unsupported_media_type" and "text/plain" in err["message"]
    png = (ROOT / "examples" / "page.png").read_bytes()
    r = client.post("/encode", content=png, headers={"Content-Type": "text/plain"})  # a file, mislabelled: read
    assert r.status_code == 200 and len(r.json()["codes"]) == NUM_CODES


def test_a_streamed_decode_whose_client_leaves_is_counted_499(server, client):
    before = metric(client, "ocr_latent_requests_total", endpoint="/decode", status="499")
    answered = metric(client, "ocr_latent_requests_total", endpoint="/decode", status="200")
    body = {"codes": [0] * NUM_CODES, "stream": True, "max_tokens": 2000, "ignore_eos": True}
    with httpx.Client(base_url=server.url, timeout=30) as leaving:
        with leaving.stream("POST", "/decode", json=body) as r:
            assert r.status_code == 200
            next(r.iter_lines())  # the first event, then hang up
    deadline = time.monotonic() + 10
    while metric(client, "ocr_latent_requests_total", endpoint="/decode", status="499") == before:
        assert time.monotonic() < deadline, "the stream's hang-up was not counted 499"
        time.sleep(0.1)
    assert metric(client, "ocr_latent_requests_total", endpoint="/decode", status="200") == answered
    time.sleep(0.5)
    assert "Task was destroyed" not in server.log_path.read_text()


def test_an_api_key_a_header_cannot_carry_stops_the_server_and_the_cli_with_a_message(tmp_path):
    srv = Server(tmp_path, "bad-key", API_KEY="clé-secrète")
    try:
        assert srv.proc.wait(60) == 1
        log = srv.log_path.read_text()
        assert "API_KEY" in log and "printable ASCII" in log and "Traceback" not in log, log
    finally:
        srv.stop()
    exe = os.path.join(os.path.dirname(sys.executable), "ocr-latent")
    r = subprocess.run([exe, "health"], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "OCR_LATENT_API_KEY": "clé", "OCR_LATENT_URL": "http://127.0.0.1:9"})
    assert r.returncode == 1 and "printable ASCII" in r.stderr and "Traceback" not in r.stderr, r.stderr
