"""Throughput of this tree against another revision, side by side in one run: what a change costs requests
that do not use it.

    nice -n 5 .venv/bin/python bench/side_by_side.py --baseline 8dbed46 --n 32 --rounds 3
    nice -n 5 .venv/bin/python bench/side_by_side.py --baseline 8dbed46 --current 3b99b61   # two revisions

Starts two servers on free loopback ports from the same .venv: this tree's, and the baseline revision's
(checked out with `git worktree` into a temporary directory and imported from there through PYTHONPATH,
ahead of the editable install). Then, round after round and alternating which server goes first, sends each
the same work, one server at a time: /encode of --n held-out pages as PNG bodies at concurrency 1 and 16,
and /decode of their codes (--max-tokens, greedy) at concurrency 1 and 16. Per level it pools the wall time
over the rounds and prints pages/s or tokens/s of each server and their ratio (this tree / baseline), and
whether both gave the same codes and the same texts. The last line is the result as JSON.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

from throughput import run, scrape, start_server, stop_server
from ocr_latent.training.pages import test_pages

ROOT = Path(__file__).resolve().parents[1]


def revision_command(revision: str, workdir: Path) -> tuple[list[str], dict, Path]:
    """A revision's server: a worktree of `revision` in `workdir`, imported as `ocr_latent` through PYTHONPATH."""
    workdir.mkdir()
    tree = workdir / "tree"
    subprocess.run(["git", "worktree", "add", "--detach", "-q", str(tree), revision], cwd=ROOT, check=True)
    (workdir / "path").mkdir()
    (workdir / "path" / "ocr_latent").symlink_to(tree)
    return [sys.executable, str(tree / "server.py")], {"PYTHONPATH": str(workdir / "path")}, tree


def measure(url: str, pngs: list[bytes], level: int, max_tokens: int, codes: list[str] | None):
    """One level against one server: (codes or texts, pages or tokens done, wall seconds)."""
    with httpx.Client(base_url=url, timeout=600, limits=httpx.Limits(max_connections=64)) as client:
        if codes is None:
            def encode(png):
                r = client.post("/encode", content=png, headers={"Content-Type": "image/png"})
                r.raise_for_status()
                return r.json()["codes_b64"]
            out, wall = run(level, encode, pngs)
            return out, len(pngs), wall

        def decode(c):
            r = client.post("/decode", json={"codes_b64": c, "max_tokens": max_tokens})
            r.raise_for_status()
            return r.json()["text"]
        before = scrape(client)
        out, wall = run(level, decode, codes)
        tokens = scrape(client)["ocr_latent_decode_tokens_total"] - before["ocr_latent_decode_tokens_total"]
        return out, tokens, wall


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", required=True, help="a git revision of this repository")
    ap.add_argument("--current", help="another revision to measure against it (default: this working tree)")
    ap.add_argument("--n", type=int, default=32, help="pages (and requests per level)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--levels", default="1,16")
    ap.add_argument("--seed", type=int, default=2)
    args = ap.parse_args(argv)
    levels = [int(x) for x in args.levels.split(",")]
    stream, pngs = test_pages(seed=args.seed), []
    for i in range(args.n):
        buf = io.BytesIO()
        stream[i].image.save(buf, "PNG")
        pngs.append(buf.getvalue())

    workdir = Path(tempfile.mkdtemp(prefix="ocr-latent-side-"))
    command, extra, tree = revision_command(args.baseline, workdir / "baseline")
    trees = [tree]
    env = {"DECODE_SLOTS": str(max(levels)), "TORCH_THREADS": os.environ.get("TORCH_THREADS", "1")}
    servers = {}
    try:
        servers["baseline"] = start_server({**env, **extra}, command)
        if args.current:
            command, extra, tree = revision_command(args.current, workdir / "current")
            trees.append(tree)
            servers["current"] = start_server({**env, **extra}, command)
        else:
            servers["current"] = start_server(env)
        urls = {name: s[1] for name, s in servers.items()}
        warm = {name: measure(url, pngs[:2], 1, args.max_tokens, None)[0] for name, url in urls.items()}
        for name, url in urls.items():
            measure(url, pngs[:2], 1, 8, warm[name])
        walls = {(name, kind, c): [0.0, 0.0] for name in urls for kind in ("encode", "decode") for c in levels}
        outputs: dict = {}
        for r in range(args.rounds):
            order = list(urls) if r % 2 == 0 else list(reversed(urls))
            for kind in ("encode", "decode"):
                for c in levels:
                    for name in order:
                        codes = None if kind == "encode" else outputs[(name, "encode")]
                        out, amount, wall = measure(urls[name], pngs, c, args.max_tokens, codes)
                        w = walls[(name, kind, c)]
                        w[0], w[1] = w[0] + wall, w[1] + amount
                        outputs.setdefault((name, kind), out)
        result = {"baseline": args.baseline, "current": args.current or "working tree", "n": args.n, "rounds": args.rounds, "max_tokens": args.max_tokens,
                  "torch_threads": env["TORCH_THREADS"], "levels": {},
                  "same_codes": outputs[("current", "encode")] == outputs[("baseline", "encode")],
                  "same_texts": outputs[("current", "decode")] == outputs[("baseline", "decode")]}
        print(f"{'level':>12} {'baseline':>10} {'current':>10} {'ratio':>7}")
        for kind, unit in (("encode", "pages/s"), ("decode", "tokens/s")):
            for c in levels:
                rate = {name: walls[(name, kind, c)][1] / walls[(name, kind, c)][0] for name in urls}
                ratio = rate["current"] / rate["baseline"]
                result["levels"][f"{kind}_c{c}"] = {"baseline": rate["baseline"], "current": rate["current"],
                                                    "ratio": ratio, "unit": unit}
                print(f"{kind + ' c' + str(c):>12} {rate['baseline']:10.2f} {rate['current']:10.2f} {ratio:7.3f}  {unit}")
        print(f"same codes: {result['same_codes']}, same texts: {result['same_texts']}")
        print(json.dumps(result))
    finally:
        for proc, *_ in servers.values():
            stop_server(proc)
        for tree in trees:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=False)


if __name__ == "__main__":
    main()
