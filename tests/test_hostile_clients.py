"""What a client can do to the server with time, connections and framing (issue 52): bodies that stop, many
connections from one address, requests framed two ways, streams left mid-way, keys a header cannot carry,
bodies of the wrong type. Each a regression test that failed on the code before it; the attacks with files
(scan bombs, slow PDFs, slot hogs) follow below."""
import json
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

from conftest import ROOT, Server, assert_error, metric, serving

pytestmark = pytest.mark.slow  # starts servers (~10 s each): left out of the fast lane, `./test.sh -m "not slow"`

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
