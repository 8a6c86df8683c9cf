"""The `ocr-latent` command (installed into .venv by setup.sh).

  ocr-latent serve      # the HTTP service; configuration by environment variable (README "Configuration")
  ocr-latent train ...  # train.py's commands: base, export, quantizer
"""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="ocr-latent", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("serve", help="serve the HTTP API on HOST:PORT (default 127.0.0.1:8000)")
    sub.add_parser("train", help="train.py's commands (ocr-latent train --help)", add_help=False)
    args, rest = ap.parse_known_args(argv)
    if args.cmd == "serve":
        if rest:
            ap.error(f"serve takes no arguments (configuration is by environment variable): {' '.join(rest)}")
        import server
        return server.main()
    import train
    train.main(rest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
