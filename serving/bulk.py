"""Whole archives on Ray Data: `ocr-latent bulk-encode DIR OUT.parquet`, `ocr-latent bulk-decode IN.parquet OUT.jsonl`.

bulk-encode reads every image (PNG, JPEG, WebP, TIFF, BMP) and every PDF page under DIR; bulk-decode reads
the codes a bulk-encode wrote. The work runs in a pool of Ray actors, each with the project's own
`engine.Engine` (so a page gives the same codes and text as /encode and /decode), fed batches of pages.

  * parquet columns: path (relative to DIR), page (from 1), codes (2,048 bytes, packed as /encode's
    codes_b64), quantizer (its fingerprint); jsonl fields: path, page, text, finish_reason, confidence;
  * a rerun skips pages already done: bulk-encode keeps what it finished in OUT.parquet.parts/ until it
    merges them into OUT.parquet, bulk-decode appends to OUT.jsonl as pages finish;
  * a file or page that cannot be read (or codes of another quantizer) is a line in OUT.errors.jsonl
    (path, page, error) and the job goes on; those are tried again by a rerun.
Ray: the cluster at RAY_ADDRESS, else a local one (RAY_NUM_CPUS, RAY_OBJECT_STORE_BYTES); the model by
the server's variables (MODEL_DIR, QUANTIZER, DEVICE, TORCH_THREADS, ...).
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from ocr_latent.serving.engine import EngineConfig, EngineError
from ocr_latent.serving.settings import settings

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".webp", ".tif", ".tiff", ".bmp"}
PARQUET_COLUMNS = ("path", "page", "codes", "quantizer")


# ----------------------------------------------------------------------------- the actors
class EngineActor:
    """One actor of the pool: an Engine in its process; a batch is submitted at once, so the engine
    batches it (encode micro-batches, continuous decode batching)."""

    def __init__(self, root: str = ""):
        from ocr_latent.serving.engine import Engine
        config = EngineConfig.from_env()
        self.root = Path(root)
        self.engine = Engine(config).start()
        self.engine.wait_ready()
        self.max_pixels = settings().max_image_pixels

    def _wait(self, jobs: dict[int, object]) -> dict[int, object]:
        """row -> result, or the error's message (str)."""
        out = {}
        for i, job in jobs.items():
            try:
                out[i] = job.future.result()
            except EngineError as e:
                out[i] = f"{type(e).__name__}: {e.message}"
        return out


class Encoder(EngineActor):
    def _image(self, path: str, page: int):
        from ocr_latent.serving.documents import DocumentError, looks_like_pdf, open_image, render_pdf
        data = (self.root / path).read_bytes()
        if looks_like_pdf(data):  # rendered as /encode renders it, at the encoder's view size
            [(_, image)] = render_pdf(data, self.engine.pipeline.mode, str(page), 1)
            return image
        try:
            return open_image(data, self.max_pixels, self.engine.pipeline.mode)  # reduced as /encode reduces it
        except DocumentError as e:
            raise ValueError(str(e)) from None

    def __call__(self, batch: dict) -> dict:
        from ocr_latent.quantizer import pack
        jobs, errors = {}, {}
        for i, (path, page) in enumerate(zip(batch["path"], batch["page"])):
            try:
                jobs[i] = self.engine.encode(self._image(str(path), int(page)))
            except Exception as e:  # noqa: BLE001 - a bad file is reported, never stops the job
                errors[i] = f"{type(e).__name__}: {e}"
        results = {**self._wait(jobs), **errors}
        fingerprint = self.engine.pipeline.quantizer_fingerprint
        n = len(batch["path"])
        ok = [not isinstance(results[i], str) for i in range(n)]
        return {"path": batch["path"], "page": batch["page"],
                "codes": np.array([pack(results[i]) if ok[i] else b"" for i in range(n)], dtype=object),
                "quantizer": np.array([fingerprint] * n, dtype=object),
                "error": np.array(["" if ok[i] else results[i] for i in range(n)], dtype=object)}


class Decoder(EngineActor):
    def __init__(self, prompt: str = "free", max_tokens: int = 4096):
        super().__init__()
        self.prompt, self.max_tokens = prompt, max_tokens

    def __call__(self, batch: dict) -> dict:
        from ocr_latent.quantizer import unpack
        own = self.engine.pipeline.quantizer_fingerprint
        jobs, errors = {}, {}
        for i, (codes, fingerprint) in enumerate(zip(batch["codes"], batch["quantizer"])):
            if fingerprint != own:
                errors[i] = f"codes of quantizer {fingerprint}; this model decodes quantizer {own}'s"
            elif len(codes) != 2048:
                errors[i] = f"codes hold {len(codes)} bytes; need 2048"
            else:
                jobs[i] = self.engine.decode(unpack(bytes(codes)).astype(np.uint8), self.prompt, self.max_tokens)
        results = {**self._wait(jobs), **errors}
        n = len(batch["path"])
        return {"path": batch["path"], "page": batch["page"],
                "text": np.array([getattr(results[i], "text", "") for i in range(n)], dtype=object),
                "finish_reason": np.array([getattr(results[i], "finish_reason", "") for i in range(n)], dtype=object),
                "confidence": np.array([getattr(results[i], "confidence", None) for i in range(n)], dtype=object),
                "error": np.array([results[i] if isinstance(results[i], str) else "" for i in range(n)], dtype=object)}


# ----------------------------------------------------------------------------- the driver
def init_ray():
    import ray
    s = settings()
    if s.ray_address:
        ray.init(address=s.ray_address, log_to_driver=False)
    else:
        ray.init(num_cpus=s.ray_num_cpus, include_dashboard=False, log_to_driver=False,
                 object_store_memory=s.ray_object_store_bytes)
    return ray


def list_pages(root: Path, errors) -> list[dict]:
    """Every page under `root`: an image is one page, a PDF as many as it has; unreadable PDFs go to `errors`."""
    from ocr_latent.serving.documents import DocumentError, looks_like_pdf, page_count
    rows = []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = str(path.relative_to(root))
        if path.suffix.lower() == ".pdf":
            try:
                data = path.read_bytes()
                if not looks_like_pdf(data):
                    raise DocumentError("not a PDF")
                rows += [{"path": rel, "page": n} for n in range(1, page_count(data) + 1)]
            except (OSError, DocumentError) as e:
                errors(rel, 0, f"{type(e).__name__}: {e}")
        elif path.suffix.lower() in IMAGE_SUFFIXES:
            rows.append({"path": rel, "page": 1})
    return rows


def run_pool(ray, rows: list[dict], actor, ctor_kwargs: dict, actors: int, batch_size: int, what: str):
    """Rows through a pool of `actors` actors, batch_size rows a call; yields output batches as they finish."""
    from tqdm import tqdm
    import ray.data
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False  # one bar, in pages, below
    ds = ray.data.from_items(rows, override_num_blocks=max(1, -(-len(rows) // batch_size)))
    s = settings()
    cpus = s.replica_cpus if s.replica_cpus is not None else float(EngineConfig.from_env().torch_threads or 1)
    out = ds.map_batches(actor, fn_constructor_kwargs=ctor_kwargs, batch_size=batch_size, batch_format="numpy",
                         compute=ray.data.ActorPoolStrategy(size=actors), num_cpus=cpus)
    with tqdm(total=len(rows), unit="page", desc=what, file=sys.stderr, mininterval=2) as bar:
        for batch in out.iter_batches(batch_size=None, batch_format="numpy"):
            yield batch
            bar.update(len(batch["path"]))


class ErrorLog:
    """OUT.errors.jsonl: this run's failures (a rerun tries them again)."""

    def __init__(self, path: Path):
        self.path, self.count = path, 0
        self.file = open(path, "w")

    def __call__(self, file: str, page: int, error: str) -> None:
        self.file.write(json.dumps({"path": file, "page": page, "error": error}) + "\n")
        self.file.flush()
        self.count += 1

    def close(self) -> None:
        self.file.close()


def bulk_encode(input_dir: Path, output: Path, actors: int = 1, batch_size: int = 8) -> int:
    """Returns the number of pages that failed (0: everything under input_dir is in output)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    if not input_dir.is_dir():
        raise SystemExit(f"ocr-latent: {input_dir} is not a folder")
    parts = output.with_name(output.name + ".parts")
    errors = ErrorLog(output.with_name(output.stem + ".errors.jsonl"))
    schema = pa.schema([("path", pa.string()), ("page", pa.int32()), ("codes", pa.binary(2048)), ("quantizer", pa.string())])
    done_tables = [pq.read_table(f, schema=schema) for f in sorted(parts.glob("*.parquet"))]
    if output.exists():
        done_tables.insert(0, pq.read_table(output, schema=schema))
    done = {(p, n) for t in done_tables for p, n in zip(t["path"].to_pylist(), t["page"].to_pylist())}
    rows = [r for r in list_pages(input_dir, errors) if (r["path"], r["page"]) not in done]
    print(f"bulk-encode: {len(rows)} page(s) to encode, {len(done)} already done", file=sys.stderr)
    t0 = time.monotonic()
    if rows:
        ray = init_ray()
        parts.mkdir(exist_ok=True)
        try:
            for batch in run_pool(ray, rows, Encoder, {"root": str(input_dir.resolve())}, actors, batch_size, "encode"):
                good = batch["error"] == ""
                for p, n, e in zip(batch["path"][~good], batch["page"][~good], batch["error"][~good]):
                    errors(str(p), int(n), str(e))
                if good.any():  # kept at once: a job stopped here resumes from these
                    table = pa.table({k: list(batch[k][good]) for k in PARQUET_COLUMNS}, schema=schema)
                    pq.write_table(table, parts / f"{time.time_ns()}.parquet")
                    done_tables.append(table)
        finally:
            ray.shutdown()
    if done_tables:
        merged = pa.concat_tables(done_tables).sort_by([("path", "ascending"), ("page", "ascending")])
        tmp = output.with_name(output.name + ".tmp")
        pq.write_table(merged, tmp)
        os.replace(tmp, output)
        for f in parts.glob("*.parquet"):
            f.unlink()
        parts.rmdir() if parts.exists() else None
    errors.close()
    rate = f", {len(rows) / (time.monotonic() - t0):.2f} pages/s" if rows else ""
    print(f"bulk-encode: {output}: {sum(len(t) for t in done_tables)} page(s){rate}; {errors.count} error(s) "
          f"in {errors.path}", file=sys.stderr)
    return errors.count


def bulk_decode(input_file: Path, output: Path, actors: int = 1, batch_size: int = 16, prompt: str = "free",
                max_tokens: int = 4096) -> int:
    import pyarrow.parquet as pq
    try:
        table = pq.read_table(input_file)
    except (OSError, ValueError) as e:
        raise SystemExit(f"ocr-latent: {input_file}: not a readable parquet file: {e}") from None
    missing = [c for c in PARQUET_COLUMNS if c not in table.column_names]
    if missing:
        raise SystemExit(f"ocr-latent: {input_file}: no column(s) {', '.join(missing)} (bulk-encode writes them)")
    done = set()
    if output.exists():
        for line in output.read_text().splitlines():
            try:
                row = json.loads(line)
                done.add((row["path"], row["page"]))
            except (ValueError, KeyError, TypeError):  # a line cut by a stopped job: its page is done again
                pass
    errors = ErrorLog(output.with_name(output.stem + ".errors.jsonl"))
    rows = [r for r in table.select(list(PARQUET_COLUMNS)).to_pylist() if (r["path"], r["page"]) not in done]
    print(f"bulk-decode: {len(rows)} page(s) to decode, {len(done)} already done", file=sys.stderr)
    t0 = time.monotonic()
    if rows:
        ray = init_ray()
        try:
            with open(output, "a") as out:
                for batch in run_pool(ray, rows, Decoder, {"prompt": prompt, "max_tokens": max_tokens},
                                      actors, batch_size, "decode"):
                    for p, n, text, reason, confidence, e in zip(batch["path"], batch["page"], batch["text"],
                                                                 batch["finish_reason"], batch["confidence"],
                                                                 batch["error"]):
                        if e:
                            errors(str(p), int(n), str(e))
                        else:
                            out.write(json.dumps({"path": str(p), "page": int(n), "text": str(text),
                                                  "finish_reason": str(reason), "confidence": confidence}) + "\n")
                    out.flush()
        finally:
            ray.shutdown()
    errors.close()
    rate = f", {len(rows) / (time.monotonic() - t0):.2f} pages/s" if rows else ""
    print(f"bulk-decode: {output}: {len(done) + len(rows) - errors.count} page(s){rate}; {errors.count} error(s) "
          f"in {errors.path}", file=sys.stderr)
    return errors.count
