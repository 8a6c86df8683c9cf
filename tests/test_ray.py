"""The Ray backend against the plain server, on a local Ray on this CPU.

One plain server (`python server.py`) and one Ray Serve service (`python ray_serve.py`: a local Ray with
2 CPUs, 1 encode and 2 decode replicas of half a CPU each, TORCH_THREADS=1) with the embedded nano model
answer the same requests: the codes and texts must be byte-identical, errors the same statuses and types.
Then a decode replica is killed (SIGKILL) under load, and the bulk jobs (Ray Data) are checked against the
plain server's /encode and /decode over 40 rendered pages.
"""
from __future__ import annotations

import base64
import concurrent.futures
import io
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import pyarrow.parquet as pq

from conftest import RAY, Server, metric, png_bytes
from ocr_latent.training.pages import test_pages

pytestmark = pytest.mark.slow  # starts servers (~10 s each): left out of the fast lane, `./test.sh -m "not slow"`

SHORT = 48  # max_tokens where many decodes run: the same prefix of the text, and a bounded test time
LIMITS = {"MAX_BODY_BYTES": 1_000_000, "TORCH_THREADS": 1, "LOG_LEVEL": "warning"}


def replica_pids(deployment: str) -> list[int]:
    """Processes of this Serve application's replicas of `deployment` (Ray names them in their title)."""
    title = f"ray::ServeReplica:ocr-latent:{deployment}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "cmdline").read_bytes().startswith(title):
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ray")
    plain = Server(tmp, "plain", **LIMITS)
    ray = Server(tmp, "ray", RAY, **LIMITS, ENCODE_REPLICAS=1, DECODE_REPLICAS=2, REPLICA_CPUS=0.5, RAY_NUM_CPUS=2,
                 RAY_OBJECT_STORE_BYTES=100_000_000, RAY_ADDRESS=None)  # a local Ray of its own
    try:
        plain.wait_healthy(60)
        ray.wait_healthy(240)
        yield plain, ray
    finally:
        ray.stop()
        plain.stop()


@pytest.fixture(scope="module")
def clients(servers):
    plain, ray = servers
    with httpx.Client(base_url=plain.url, timeout=180) as p, httpx.Client(base_url=ray.url, timeout=180) as r:
        yield p, r


@pytest.fixture(scope="module")
def images():
    stream = test_pages(seed=3)
    return [stream[i].image for i in range(22)]


def pdf_bytes(images) -> bytes:
    buf = io.BytesIO()
    images[0].save(buf, "PDF", save_all=True, append_images=images[1:])
    return buf.getvalue()


def error_of(r: httpx.Response) -> tuple[int, str | None]:
    return r.status_code, (r.json().get("error", {}).get("type") if r.status_code != 200 else None)


def test_health_errors_and_metrics_are_the_plain_servers(clients):
    plain, ray = clients
    assert ray.get("/health").json() == plain.get("/health").json()
    quantizer = plain.get("/health").json()["quantizer"]
    codes = base64.b64encode(bytes(2048)).decode()
    bad = [("GET", "/nowhere", {}), ("POST", "/decode", {"content": b"{not json"}), ("POST", "/decode", {"json": {}}),
           ("POST", "/decode", {"json": {"codes_b64": codes, "quantizer": "0" * 16}}),
           ("POST", "/decode", {"json": {"codes_b64": codes, "prompt": "markdown"}}),  # nano cannot spell it
           ("POST", "/decode", {"json": {"codes_b64": codes[:-8]}}),
           ("POST", "/decode", {"json": {"codes_b64": codes, "max_tokens": 8192}}),  # beyond a cache slot
           ("POST", "/decode", {"json": {"codes_b64": codes, "min_tokens": 8192}}),  # the same, by min_tokens
           ("POST", "/decode?max_tokens=10", {"json": {"codes_b64": codes, "min_tokens": 11}}),
           ("POST", "/encode", {"content": b"not an image", "headers": {"Content-Type": "image/png"}}),
           ("POST", "/encode", {"content": b"x" * 1_100_000, "headers": {"Content-Type": "image/png"}})]
    for method, path, kw in bad:
        want = error_of(plain.request(method, path, **kw))
        assert want[0] >= 400
        assert error_of(ray.request(method, path, **kw)) == want, (method, path)
    r = ray.get("/health", headers={"X-Request-ID": "ray-check-1"})
    assert r.headers.get_list("x-request-id") == ["ray-check-1"]
    assert r.status_code == 200 and r.json()["quantizer"] == quantizer
    metrics = ray.get("/metrics")
    assert metrics.status_code == 200 and 'ocr_latent_requests_total{endpoint="/decode",status="409"}' in metrics.text
    schema = ray.get("/openapi.json").json()
    assert schema["paths"]["/decode"]["post"]["requestBody"]["content"]["application/json"]["schema"][
        "properties"]["quantizer"]["enum"] == [quantizer]


def test_a_client_that_hangs_up_mid_decode_is_counted_as_499_without_a_traceback(servers, clients):
    """Serve's proxy cancels the request of a client that left: /metrics counts it as 499, as the plain
    server does, not as a server error, and the log holds no traceback for it."""
    _, ray = clients
    codes = base64.b64encode(bytes(2048)).decode()
    before = {s: metric(ray, "ocr_latent_requests_total", endpoint="/decode", status=s) for s in ("499", "500")}
    log_before = servers[1].log_path.read_text()
    with pytest.raises(httpx.TimeoutException):  # reads past the page's end for 4,000 tokens: long after 1 s
        ray.post("/decode", json={"codes_b64": codes, "max_tokens": 4000, "ignore_eos": True}, timeout=1.0)
    deadline = time.monotonic() + 60
    while metric(ray, "ocr_latent_requests_total", endpoint="/decode", status="499") < before["499"] + 1:
        assert time.monotonic() < deadline, "the hang-up was not counted as 499"
        time.sleep(0.5)
    assert metric(ray, "ocr_latent_requests_total", endpoint="/decode", status="500") == before["500"]
    assert "Traceback" not in servers[1].log_path.read_text()[len(log_before):]


def test_same_codes_and_texts_as_the_plain_server(clients, images):
    plain, ray = clients
    for image in images[:3]:
        body = {"content": png_bytes(image), "headers": {"Content-Type": "image/png"}}
        want = plain.post("/encode", **body).json()
        assert ray.post("/encode", **body).json() == want
        request = {"codes_b64": want["codes_b64"], "quantizer": want["quantizer"]}
        text = plain.post("/decode", json=request).json()
        assert ray.post("/decode", json=request).json() == text
        with ray.stream("POST", "/decode", json={**request, "stream": True}) as r:  # streamed through Ray
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
        assert "".join(e["text"] for e in events[:-1]) == text["text"] and events[-1] == text
    fixed = {**request, "max_tokens": text["num_tokens"] + 8, "ignore_eos": True}  # read on past the page's end
    assert ray.post("/decode", json=fixed).json() == plain.post("/decode", json=fixed).json()
    with ray.stream("POST", "/decode", json={**fixed, "stream": True}) as r:
        done = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")][-1]
    assert (done["num_tokens"], done["finish_reason"]) == (text["num_tokens"] + 8, "length")
    pdf = {"content": pdf_bytes(images[3:5]), "headers": {"Content-Type": "application/pdf"}}
    olc = plain.post("/encode?format=olc", **pdf).content
    assert ray.post("/encode?format=olc", **pdf).content == olc
    olc_body = {"content": olc, "headers": {"Content-Type": "application/vnd.ocr-latent.codes"}}
    assert ray.post("/decode?max_tokens=48", **olc_body).json() == plain.post("/decode?max_tokens=48", **olc_body).json()


def decode_short(client: httpx.Client, codes_b64: str) -> httpx.Response:
    return client.post("/decode", json={"codes_b64": codes_b64, "max_tokens": SHORT})


@pytest.fixture(scope="module")
def short_texts(clients, images):
    """codes_b64 -> the plain server's text at SHORT tokens, for 16 pages."""
    plain, _ = clients
    with ThreadPoolExecutor(16) as pool:
        codes = list(pool.map(lambda im: plain.post("/encode", content=png_bytes(im), headers={
            "Content-Type": "image/png"}).json()["codes_b64"], images[:16]))
        texts = list(pool.map(lambda c: decode_short(plain, c).json(), codes))
    return dict(zip(codes, texts))


def test_sixteen_concurrent_clients_get_200s(servers, short_texts, images):
    _, ray = servers

    def one_client(i: int):
        with httpx.Client(base_url=ray.url, timeout=180) as c:
            enc = c.post("/encode", content=png_bytes(images[i]), headers={"Content-Type": "image/png"})
            return enc, decode_short(c, enc.json()["codes_b64"]) if enc.status_code == 200 else None

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(one_client, range(16)))
    assert [(e.status_code, d.status_code) for e, d in answers] == [(200, 200)] * 16
    assert [d.json() for _, d in answers] == list(short_texts.values())


def test_killing_a_decode_replica_loses_no_request(servers, short_texts):
    _, ray = servers
    victims = replica_pids("decode")
    assert len(victims) == 2, victims
    codes = list(short_texts) * 4  # 64 requests over both replicas

    def one(c: str) -> httpx.Response:
        with httpx.Client(base_url=ray.url, timeout=180) as client:
            return decode_short(client, c)

    with ThreadPoolExecutor(len(codes)) as pool:
        pending = [pool.submit(one, c) for c in codes]
        # kill as soon as the first answers arrive: the replicas are busy, most requests still on them
        concurrent.futures.wait(pending, timeout=60, return_when=concurrent.futures.FIRST_COMPLETED)
        assert not all(f.done() for f in pending), "the load ended before the kill: make it longer"
        os.kill(victims[0], signal.SIGKILL)
        answers = [f.result() for f in pending]
    for c, r in zip(codes, answers):
        # resent to the other replica: same text; the documented retryable error is a 503 with Retry-After
        if r.status_code == 503:
            assert r.json()["error"]["type"] == "unavailable" and "retry-after" in r.headers
            r = one(c)
        assert r.status_code == 200 and r.json() == short_texts[c]
    deadline = time.monotonic() + 150  # Serve replaces the replica (a new process loads the model)
    while time.monotonic() < deadline and not (len(alive := replica_pids("decode")) == 2 and victims[0] not in alive):
        time.sleep(1)
    assert len(replica_pids("decode")) == 2 and victims[0] not in replica_pids("decode"), "the service did not heal"
    with ThreadPoolExecutor(8) as pool:
        again = list(pool.map(one, codes[:8]))
    assert [r.json() for r in again] == [short_texts[c] for c in codes[:8]]


def test_bulk_jobs_match_encode_and_decode(servers, clients, images, tmp_path):
    plain_server, ray_server = servers
    ray_server.stop()  # the bulk job starts its own local Ray: leave it the two cores
    plain, _ = clients
    folder = tmp_path / "archive"
    (folder / "scans").mkdir(parents=True)
    for i, image in enumerate(images[:6]):
        (folder / "scans" / f"{i:02d}.png").write_bytes(png_bytes(image))
    (folder / "report.pdf").write_bytes(pdf := pdf_bytes(images[6:8]))
    (folder / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    out, texts = tmp_path / "codes.parquet", tmp_path / "texts.jsonl"
    env = {**os.environ, "TORCH_THREADS": "1", "RAY_NUM_CPUS": "2", "RAY_OBJECT_STORE_BYTES": "100000000"}
    env.pop("RAY_ADDRESS", None)
    cli = [str(Path(sys.executable).with_name("ocr-latent"))]
    # small batches: the 9 pages are several blocks, shared by the two actors
    run = subprocess.run(cli + ["bulk-encode", str(folder), str(out), "--actors", "2", "--batch-size", "3"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 1, run.stderr[-3000:]  # one bad file: reported, and the job finished
    errors = [json.loads(line) for line in out.with_name("codes.errors.jsonl").read_text().splitlines()]
    assert [(e["path"], e["page"]) for e in errors] == [("broken.png", 1)]
    assert "9/9" in run.stderr  # the progress bar, in pages (the broken file is one)

    table = pq.read_table(out).to_pylist()
    assert len(table) == 8 and {len(r["codes"]) for r in table} == {2048}
    want = {f"scans/{i:02d}.png": plain.post("/encode", content=png_bytes(im), headers={"Content-Type": "image/png"}).json()
            for i, im in enumerate(images[:6])}
    for page in plain.post("/encode", content=pdf, headers={"Content-Type": "application/pdf"}).json()["pages"]:
        want[f"report.pdf#{page['page']}"] = page
    got = {r["path"] + (f"#{r['page']}" if r["path"].endswith(".pdf") else ""): r for r in table}
    assert sorted(got) == sorted(want)
    assert all(base64.b64decode(want[k]["codes_b64"]) == got[k]["codes"] for k in want)
    assert {r["quantizer"] for r in table} == {plain.get("/health").json()["quantizer"]}

    rerun = subprocess.run(cli + ["bulk-encode", str(folder), str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert "1 page(s) to encode, 8 already done" in rerun.stderr, rerun.stderr[-3000:]
    assert pq.read_table(out).to_pylist() == table

    run = subprocess.run(cli + ["bulk-decode", str(out), str(texts), "--max-tokens", str(SHORT), "--batch-size", "3"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [json.loads(line) for line in texts.read_text().splitlines()]
    assert len(lines) == 8
    with ThreadPoolExecutor(16) as pool:
        expected = list(pool.map(lambda r: decode_short(plain, base64.b64encode(r["codes"]).decode()).json(), table))
    by_page = {(x["path"], x["page"]): x for x in lines}
    assert [{k: by_page[(r["path"], r["page"])][k] for k in ("text", "finish_reason")} for r in table] == \
        [{"text": e["text"], "finish_reason": e["finish_reason"]} for e in expected]
