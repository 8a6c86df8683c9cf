"""training_manifest.json: one record per shipped artifact (see MANIFEST_FORMAT), with the data,
seeds, hyperparameters, metrics and hashes that made it."""
from __future__ import annotations

import hashlib
import json
import subprocess
import time
from pathlib import Path

from ocr_latent.architecture import ROOT
from ocr_latent.training.pages import PageMix, PageSpec, sources_manifest, train_only_documents


def code_commit() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        return rev + ("+uncommitted" if dirty else "") if rev else "unknown"
    except OSError:
        return "unknown"


MANIFEST_FORMAT = ("one record per shipped artifact under 'artifacts'; a record that replaced another moves the "
                   "older one to 'earlier', keyed by its weights_sha256, and later records name it by that hash "
                   "('initialized_from'); full training curves are files under training_curves/ ('curve_file')")


def update_manifest(artifact: str, record: dict, path: Path = ROOT / "training_manifest.json") -> str:
    """Record one trained artifact in the manifest (flat: see MANIFEST_FORMAT); returns the record's sha256."""
    manifest = json.loads(path.read_text()) if path.exists() else {}
    manifest = {"format": MANIFEST_FORMAT, "artifacts": manifest.get("artifacts", {}), "earlier": manifest.get("earlier", {})}
    # a record may name the commit its code was read at (a long run's start); else the code as it is now
    record = {"code_commit": code_commit(), **record, "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    old = manifest["artifacts"].get(artifact)
    if old and old.get("weights_sha256") and old.get("weights_sha256") != record.get("weights_sha256"):
        manifest["earlier"][old["weights_sha256"]] = {"artifact": artifact, **old}
    manifest["artifacts"][artifact] = record
    path.write_text(json.dumps(manifest, indent=1) + "\n")
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


def curve_file(manifest: Path, name: str, curve) -> str:
    """Write a full training curve beside the manifest, named by its content (records that share a curve
    share the file); returns its path relative to the manifest's folder. `name` says what it is."""
    text = json.dumps({"name": name, "curve": curve}, separators=(",", ":")) + "\n"
    body = json.dumps(curve, separators=(",", ":"))
    path = manifest.parent / "training_curves" / f"{hashlib.sha256(body.encode()).hexdigest()[:16]}.json"
    path.parent.mkdir(exist_ok=True)
    if not path.exists():
        path.write_text(text)
    return str(path.relative_to(manifest.parent))


def spec_record(spec: PageSpec | PageMix) -> dict:
    if isinstance(spec, PageMix):
        return {"mix": [spec_record(s) | {"weight": w} for s, w in zip(spec.specs, spec.weights)]}
    return vars(spec) | {"fonts": list(spec.fonts), "shapes": [list(s) for s in spec.shapes]}


def data_record(docs: dict, seed: int, spec: PageSpec | PageMix, pages: dict, more_text: bool = False) -> dict:
    """The record of rendered training data: `docs` by split, and the train-only documents when training pages
    drew their text from them too (--more-text)."""
    sources = docs | ({"train-only": train_only_documents()} if more_text else {})
    return {"generator": "pages.py (rendered with Pillow, DejaVu fonts)", "seed": seed, "page_spec": spec_record(spec),
            "split_by": "document", "pages": pages, "sources": sources_manifest(sources)}
