"""ocr-latent: a document image -> 4096 four-bit codes (2 KiB) -> the page's text, on DeepSeek-OCR's
DeepEncoder and MoE decoder.

The package directory is the repository root (pyproject maps `ocr_latent` to `.`), so the design
card's modules sit where a reader looks for them:

  architecture   architecture.json read once (pinned base, code geometry, prompts)
  encoder        the DeepEncoder (SAM-B + CLIP-L towers + projector), page views
  decoder        the DeepSeek-V2 MoE decoder model and its batched KV cache
  generation     greedy generation on that decoder: continuous batching, cache slots, CUDA graphs
  quantizer      the FSQ quantizers, `pack`/`unpack`
  checkpoint     the original checkpoint layout
  server         the HTTP face (FastAPI endpoints)
  train          the training command (nano base stages, export, quantizer)

and the rooms: `client/` (HTTP client, the `ocr-latent` command, the codes file; no torch at import),
`serving/` (settings, engine, pipeline, documents, the uvicorn runner, Ray Serve, bulk jobs) and
`training/` (rendered pages, nano, losses, features, evaluation, reading metrics, the quantizer trainer).
"""
__version__ = "0.1.0"
