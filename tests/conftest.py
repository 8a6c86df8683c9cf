"""What the test modules share: paths, small configs, and the one harness that runs a server.

Test modules import from here (`from conftest import ...`), never from each other.
"""
from __future__ import annotations

import contextlib
import io
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import httpx
import pytest
import torch
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"

from ocr_latent.checkpoint import build_modules, init_weights


def needs_shared(*parts: str) -> Path:
    """Path under ../shared, or skip: a user's clone has no ../shared (fixtures of the team's CI)."""
    path = SHARED.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"{path} is absent: ../shared (parity fixtures, real config) is only beside the team's checkout")
    return path


@pytest.fixture(scope="session")
def nano_v1(tmp_path_factory) -> Path:
    """Nano v1, the default before v4 (3 decoder layers, ASCII), read from the commit that shipped it; skip in a
    clone without that history (a shallow one)."""
    from ocr_latent.training.nano import shipped_v1
    try:
        return shipped_v1(tmp_path_factory.mktemp("nano-v1"))
    except FileNotFoundError as e:
        pytest.skip(str(e))


def small_config(vocab: int = 300, experts: int = 8, top_k: int = 3, layers: int = 3) -> dict:
    """A DeepSeek-OCR config.json in the original layout at toy sizes (CLIP width = SAM output)."""
    language = {"bos_token_id": 0, "eos_token_id": 1, "first_k_dense_replace": 1, "hidden_size": 64,
                "intermediate_size": 96, "moe_intermediate_size": 32, "n_routed_experts": experts,
                "n_shared_experts": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
                "num_experts_per_tok": top_k, "num_hidden_layers": layers, "vocab_size": vocab}
    return {"_name_or_path": "test/small", "language_config": dict(language), **language,
            "projector_config": {"input_dim": 128, "n_embed": 64, "projector_type": "linear"},
            "vision_config": {"image_size": 1024, "width": {
                "clip-l-14-224": {"heads": 2, "layers": 1, "width": 64, "image_size": 224, "patch_size": 14},
                "sam_vit_b": {"downsample_channels": [32, 64], "global_attn_indexes": [1], "heads": 2,
                              "layers": 2, "width": 32, "neck_channels": 16}}}}


@pytest.fixture(scope="session")
def small_modules():
    torch.manual_seed(0)
    encoder, decoder = build_modules(small_config(), "cpu")
    init_weights(encoder, decoder, seed=1, std=0.1)
    return encoder.eval(), decoder.eval()


# ----------------------------------------------------------------------------- servers
def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (now): for a server, or for a client to miss."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Launch:
    """One way of starting the service, and of stopping it."""
    argv: tuple[str, ...]
    stop_signal: int = signal.SIGINT
    stop_timeout_s: float = 20.0  # then SIGKILL
    own_session: bool = False  # its own process group: a SIGKILL ends the whole group (what Ray started)
    proxy: bool = False  # a proxy answers (not JSON) before the app is up; the app answers loading, then ok
    poll_s: float = 0.05


PLAIN = Launch((sys.executable, "server.py"))
SERVE_SH = replace(PLAIN, argv=("bash", str(ROOT / "serve.sh")))
# what `BACKEND=ray ./serve.sh` runs; until Serve's proxy has the ingress replica it answers 404 (text) itself
RAY = Launch((sys.executable, "-m", "ocr_latent.serving.ray_serve"), stop_signal=signal.SIGTERM, stop_timeout_s=60.0,
             own_session=True, proxy=True, poll_s=0.2)


class Server:
    """The service in a subprocess on a free port of 127.0.0.1, its output in `tmp/<name>.log`.

    `env` is added to this process's environment after HOST, PORT, TORCH_THREADS=1 (the CI box has 2 cores
    shared with a training job: oversubscribed OpenMP threads make every decode step ~50x slower) and
    LOG_LEVEL=warning; a value of None removes the variable. `health_history` records every /health
    answer seen while waiting: (status, JSON body or None, headers)."""

    def __init__(self, tmp: Path, name: str, launch: Launch = PLAIN, cwd: Path = ROOT, **env):
        self.launch, self.name = launch, name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / f"{name}.log"
        full_env = {**os.environ, "HOST": "127.0.0.1", "PORT": str(self.port), "TORCH_THREADS": "1",
                    "LOG_LEVEL": "warning", **{k: str(v) for k, v in env.items() if v is not None}}
        for k in [k for k, v in env.items() if v is None]:
            full_env.pop(k, None)
        self.log_file = open(self.log_path, "w")
        self.started = time.monotonic()
        self.proc = subprocess.Popen(list(launch.argv), cwd=cwd, env=full_env, stdout=self.log_file,
                                     stderr=subprocess.STDOUT, start_new_session=launch.own_session)
        self.health_history: list[tuple[int, dict | None, dict]] = []
        self.startup_s: float | None = None  # from start to the first 200 from /health

    def log(self) -> str:
        return self.log_path.read_text()[-4000:]

    def wait(self, timeout: float) -> bool:
        """Poll /health until it answers 200 (True), or the process exits or `timeout` s have passed since
        it started (False)."""
        deadline = self.started + timeout
        with httpx.Client(timeout=5.0) as c:
            while time.monotonic() < deadline and self.proc.poll() is None:
                try:
                    r = c.get(self.url + "/health")
                except httpx.TransportError:
                    time.sleep(self.launch.poll_s)
                    continue
                is_json = r.headers.get("content-type") == "application/json"
                body = r.json() if is_json or not self.launch.proxy else None
                self.health_history.append((r.status_code, body, dict(r.headers)))
                if self.launch.proxy and is_json:  # the app itself: as the plain server's /health
                    assert r.status_code == 200 or body == {"status": "loading"} and "retry-after" in r.headers
                if r.status_code == 200 and body is not None:
                    self.startup_s = time.monotonic() - self.started
                    return True
                time.sleep(self.launch.poll_s)
        return False

    def wait_healthy(self, timeout: float = 30.0) -> None:
        if not self.wait(timeout):
            rc = self.proc.poll()
            state = f"exited with {rc}" if rc is not None else f"not healthy within {timeout}s"
            raise AssertionError(f"{self.name} ({' '.join(self.launch.argv[1:])}) {state}:\n{self.log()}")

    def stop(self) -> int:
        """Stop it as a user would (Ctrl-C, or SIGTERM for Ray), then kill it; safe to call twice."""
        if self.proc.poll() is None:
            self.proc.send_signal(self.launch.stop_signal)
            try:
                self.proc.wait(self.launch.stop_timeout_s)
            except subprocess.TimeoutExpired:
                if self.launch.own_session:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                else:
                    self.proc.kill()
                self.proc.wait()
        if not self.log_file.closed:
            self.log_file.close()
        return self.proc.returncode


@contextlib.contextmanager
def serving(tmp: Path, name: str, timeout: float = 60.0, launch: Launch = PLAIN, **env):
    """A healthy server for the block (see `Server`), stopped after it, also when it never became healthy."""
    srv = Server(tmp, name, launch, **env)
    try:
        srv.wait_healthy(timeout)
        yield srv
    finally:
        srv.stop()


# ----------------------------------------------------------------------------- talking to one
def png_bytes(image: Image.Image, fmt: str = "PNG", **kw) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **kw)
    return buf.getvalue()


def rss_bytes(pid: int) -> int:
    """A process's resident memory (VmRSS), bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def assert_error(r: httpx.Response, status: int) -> dict:
    """The documented error body, {"error": {"type", "message"}}, with this status; returns the error."""
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"} and isinstance(body["error"]["type"], str), body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"], body
    return body["error"]


def metric(client, name: str, **labels) -> float:
    """Sum of the samples of `name` (exact) whose labels include `labels`."""
    total = 0.0
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        head, _, value = line.rpartition(" ")
        if head.split("{")[0] == name and all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total
