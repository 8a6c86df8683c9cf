"""The `ocr-latent` command (installed into .venv by setup.sh).

  ocr-latent serve                          # the HTTP service; configuration by environment variable (README)
  ocr-latent encode page.png -o page.olc    # an image or a PDF -> a codes file, through a running server
  ocr-latent encode doc.pdf --pages 1-3     # -> doc.olc, one set of 4096 codes per page
  ocr-latent decode page.olc                # a codes file -> its text on stdout (pages separated by a form feed)
  ocr-latent decode page.olc --stream       # ... printed as it is generated
  ocr-latent health                         # the server's /health
  ocr-latent bulk-encode DIR out.parquet    # every image and PDF page under DIR -> codes, on Ray Data (bulk.py)
  ocr-latent bulk-decode out.parquet out.jsonl   # those codes -> text, one JSON line a page
  ocr-latent train ...                      # train.py's commands: base, export, quantizer, report

encode, decode and health talk to --url (default $OCR_LATENT_URL, else http://127.0.0.1:8000) with
--api-key (default $OCR_LATENT_API_KEY). Exit status: 0 done, 1 refused or unreachable (the reason
on stderr), 2 bad usage.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


PAGE_SEPARATOR = "\f\n"  # between pages of decoded text, as pdftotext separates pages


SERVE_EPILOG = """\
  HOST, PORT                 where to listen (127.0.0.1, 8000)
  API_KEY, API_KEY_FILE      require Authorization: Bearer <key> on /encode, /decode, /metrics
  MODEL_DIR, QUANTIZER       an original-layout DeepSeek-OCR directory and its quantizer (default: embedded nano)
  DEVICE, DTYPE              cpu, cuda, cuda:1 ...; float32, bf16, fp16
  DECODE_SLOTS, KV_CACHE_TOKENS, COMPILE, ENCODE_BATCH_WINDOW_MS, ENCODE_MAX_BATCH   batching
  MAX_QUEUE, REQUEST_TIMEOUT_S, MAX_BODY_BYTES, MAX_IMAGE_PIXELS, MAX_PAGES            limits
  LOG_LEVEL, ACCESS_LOG, LOG_FORMAT, BACKEND (local or ray)
Every variable, its default and meaning: README.md, "Configuration" (serving/settings.py)."""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="ocr-latent", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("serve", help="serve the HTTP API on HOST:PORT (default 127.0.0.1:8000)", epilog=SERVE_EPILOG,
                   description="Serve the HTTP API. Configured by environment variables only:",
                   formatter_class=argparse.RawDescriptionHelpFormatter)
    sub.add_parser("train", help="train.py's commands (ocr-latent train --help)", add_help=False)

    remote = argparse.ArgumentParser(add_help=False)
    remote.add_argument("--url", default=None,
                        help="the server (default $OCR_LATENT_URL, else http://127.0.0.1:8000)")
    remote.add_argument("--api-key", default=None,
                        help="its API key (default $OCR_LATENT_API_KEY)")
    remote.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for an answer (default 600)")
    enc = sub.add_parser("encode", parents=[remote], help="an image or PDF -> a codes file (.olc)")
    enc.add_argument("input", type=Path, help="a page image (PNG, JPEG, WebP, TIFF, BMP) or a PDF")
    enc.add_argument("-o", "--output", help="the codes file (default INPUT with .olc; - for stdout)")
    enc.add_argument("--pages", help="PDF pages, 1-based, e.g. 1-3,5 (default all)")
    dec = sub.add_parser("decode", parents=[remote], help="a codes file -> text on stdout")
    dec.add_argument("input", help="a codes file (.olc; - for stdin), or the 2,048 bytes of one page's bare codes")
    dec.add_argument("--prompt", choices=("free", "markdown"), default="free")
    dec.add_argument("--max-tokens", type=int, default=4096)
    dec.add_argument("--min-tokens", type=int, default=0,
                     help="fewest tokens a page's text has: EOS and the repetition rule cannot end it sooner")
    dec.add_argument("--ignore-eos", action="store_true", help="generate every page to --max-tokens (benchmarks)")
    dec.add_argument("--stream", action="store_true", help="print the text as it is generated")
    dec.add_argument("--json", action="store_true", help="print the server's answer per page as JSON lines")
    sub.add_parser("health", parents=[remote], help="the server's /health, as JSON")
    pool = argparse.ArgumentParser(add_help=False)
    pool.add_argument("--actors", type=int, default=1, help="actors in the pool, each with a model (default 1)")
    benc = sub.add_parser("bulk-encode", parents=[pool], help="a folder of images and PDFs -> codes in parquet (Ray Data)")
    benc.add_argument("input", type=Path, help="a folder: its images and PDFs, read page by page (subfolders too)")
    benc.add_argument("output", type=Path, help="the parquet file (path, page, codes, quantizer); a rerun adds what is missing")
    benc.add_argument("--batch-size", type=int, default=8, help="pages an actor takes at once (default 8)")
    bdec = sub.add_parser("bulk-decode", parents=[pool], help="codes in parquet -> text in jsonl (Ray Data)")
    bdec.add_argument("input", type=Path, help="a parquet file bulk-encode wrote")
    bdec.add_argument("output", type=Path, help="the jsonl file (path, page, text, finish_reason); a rerun adds what is missing")
    bdec.add_argument("--batch-size", type=int, default=16, help="pages an actor takes at once (default 16)")
    bdec.add_argument("--prompt", choices=("free", "markdown"), default="free")
    bdec.add_argument("--max-tokens", type=int, default=4096)

    args, rest = ap.parse_known_args(argv)
    from ocr_latent.serving.settings import settings  # here, not at import: client/ starts without the service
    if args.cmd == "train":
        from ocr_latent import train
        train.main(rest, prog="ocr-latent train")
        return 0
    if rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.cmd == "serve":
        backend = settings().backend.lower()
        if backend not in ("local", "ray"):
            raise SystemExit(f"ocr-latent: BACKEND={backend}: use local (one process, the default) or ray (Ray Serve)")
        if backend == "ray":
            from ocr_latent.serving import ray_serve
            return ray_serve.main()
        from ocr_latent import server
        return server.main()
    if args.cmd in ("bulk-encode", "bulk-decode"):
        if args.actors < 1 or args.batch_size < 1 or getattr(args, "max_tokens", 1) < 1:
            ap.error("--actors, --batch-size and --max-tokens must be >= 1")
        from ocr_latent.serving import bulk
        if args.cmd == "bulk-encode":
            failed = bulk.bulk_encode(args.input, args.output, args.actors, args.batch_size)
        else:
            failed = bulk.bulk_decode(args.input, args.output, args.actors, args.batch_size, args.prompt, args.max_tokens)
        return 1 if failed else 0

    from ocr_latent.client import Client, ClientError
    from ocr_latent.client.codesfile import SUFFIX, CodesFile, CodesFileError, raw_codes_file
    url = args.url or settings().url  # $OCR_LATENT_URL, else http://127.0.0.1:8000
    api_key = args.api_key if args.api_key is not None else settings().client_api_key
    try:
        with Client(url, api_key, args.timeout) as client:
            if args.cmd == "health":
                print(json.dumps(client.health()))
            elif args.cmd == "encode":
                data = read_input(args.input)
                out = args.output or str(args.input.with_suffix(SUFFIX))
                if out != "-" and not Path(out).resolve().parent.is_dir():  # before the server's work, not after
                    raise SystemExit(f"ocr-latent: cannot write {out}: no directory {Path(out).parent}")
                fidelity: list[float] = []
                doc = client.encode(data, args.pages, fidelity)
                for page, f in enumerate(fidelity, 1):
                    if f < LOW_FIDELITY:
                        print(f"ocr-latent: {args.input}: page {page}'s codes carry it poorly (fidelity {f:.2f}): "
                              f"keep the original", file=sys.stderr)
                if out == "-":
                    sys.stdout.buffer.write(doc.to_bytes())
                else:
                    write_output(Path(out), doc.to_bytes())
                    print(f"{out}: {len(doc.pages)} page(s) of 4096 codes, quantizer {doc.quantizer}", file=sys.stderr)
            else:
                raw = sys.stdin.buffer.read() if args.input == "-" else read_input(Path(args.input))
                try:
                    doc = raw_codes_file(raw, client.health) or CodesFile.from_bytes(raw)
                except CodesFileError as e:
                    raise SystemExit(f"ocr-latent: {args.input}: {e}") from None
                if doc.quantizer_unchecked:
                    print(f"ocr-latent: {args.input}: bare codes ({len(raw)} bytes) name no quantizer: read with the "
                          f"server's ({doc.quantizer}); a codes file from `ocr-latent encode` would be checked",
                          file=sys.stderr)
                decode(client, doc, args)
    except ClientError as e:
        print(f"ocr-latent: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `ocr-latent decode x.olc | head`
        return 0
    return 0


def write_output(path: Path, data: bytes) -> None:
    try:
        path.write_bytes(data)
    except OSError as e:
        raise SystemExit(f"ocr-latent: cannot write {path}: {e.strerror or e}") from None


def read_input(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise SystemExit(f"ocr-latent: cannot read {path}: {e.strerror or e}") from None


# below this `encode` warns: fidelity is the chance that the reading through the codes stays within CER 0.1 of
# the uncompressed reading, which most of nano's pages (the example's 0.47) do not reach with certainty
LOW_FIDELITY = 0.2


def decode(client, doc, args) -> None:
    out = sys.stdout
    if args.stream:
        for i, codes in enumerate(doc.pages):
            if i and not args.json:
                out.write(PAGE_SEPARATOR)
            final: dict = {}
            for piece in client.decode_stream(codes, doc.quantizer, args.prompt, args.max_tokens, final,
                                              args.min_tokens, args.ignore_eos):
                if not args.json:
                    out.write(piece)
                    out.flush()
            out.write(json.dumps({"page": i + 1, **final}) + "\n" if args.json else "\n")
        return
    pages = client.decode(doc, args.prompt, args.max_tokens, args.min_tokens, args.ignore_eos)
    if args.json:
        out.writelines(json.dumps(p) + "\n" for p in pages)
    else:
        out.write(PAGE_SEPARATOR.join(p["text"] + "\n" for p in pages))


if __name__ == "__main__":
    sys.exit(main())
