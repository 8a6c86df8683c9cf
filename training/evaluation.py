"""Pages as the towers take them (rendered ahead of training steps, in worker processes or not), and greedy
reading of pages by a model, uncompressed or through a quantizer's codes, scored by CER/WER."""
from __future__ import annotations

import multiprocessing
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor

import numpy as np
import torch

from ocr_latent.checkpoint import OCRModel
from ocr_latent.generation import Generator, RepetitionRule
from ocr_latent.encoder import make_view, views_to_tensor
from ocr_latent.training.losses import order_targets, reading_prompt
from ocr_latent.training.pages import Document, Page, PageMix, PageSpec, PageStream
from ocr_latent.training.reading_metrics import cer, wer


def pixels_of(pages, mode: str) -> torch.Tensor:
    return views_to_tensor([make_view(p.image, mode) for p in pages])


_documents: list[Document] = []  # a rendering worker's documents (use_documents), sent once, not with every batch


def use_documents(documents: list[Document]) -> None:
    global _documents
    _documents = documents


def render_batch(kind: PageSpec | PageMix, seed: int, indices: list[int], mode: str,
                 documents: list[Document] | None = None) -> tuple[list[Page], torch.Tensor]:
    """Pages `indices` of the stream `seed` of `kind` over `documents` (a worker's own, use_documents, when None),
    and their pixels: a pure function of its arguments, so pages rendered in another process are the same pages."""
    stream = PageStream(_documents if documents is None else documents, kind, seed=seed)
    pages = [stream[i] for i in indices]
    return pages, pixels_of(pages, mode)


class Renderers:
    """Where batches of pages are rendered ahead of the step that uses them: `workers` processes (a GPU's steps
    outrun one CPU's rendering), or with 0 one thread beside the training loop (PIL renders mostly outside the
    GIL; on a CPU the step itself wants the cores). `ahead` batches are rendered ahead, no more: each holds
    [batch, 3, S, S] fp32 pixels."""

    def __init__(self, workers: int, documents: list[Document]):
        self.ahead = max(1, workers)
        if workers:  # spawned, not forked: a fork of a process whose torch has started its thread pools can hang
            self.pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                            initializer=use_documents, initargs=(documents,))
            self.documents = None  # each process was given them once
        else:
            self.pool, self.documents = ThreadPoolExecutor(1), documents

    def submit(self, kind: PageSpec | PageMix, seed: int, indices: list[int], mode: str) -> Future:
        """render_batch, as it is being done."""
        return self.pool.submit(render_batch, kind, seed, indices, mode, self.documents)

    def shutdown(self) -> None:
        self.pool.shutdown(cancel_futures=True)

    def __enter__(self) -> "Renderers":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def rendered(kind: PageSpec | PageMix, seed: int, batches: list[list[int]], mode: str, documents: list[Document],
             workers: int = 0) -> Iterator[tuple[list[Page], torch.Tensor]]:
    """render_batch of each batch of page indices, in order, rendered ahead by Renderers."""
    with Renderers(workers, documents) as renderers:
        pending = deque(renderers.submit(kind, seed, b, mode) for b in batches[:renderers.ahead])
        for n in range(len(batches)):
            batch = pending.popleft().result()
            if n + renderers.ahead < len(batches):
                pending.append(renderers.submit(kind, seed, batches[n + renderers.ahead], mode))
            yield batch


@torch.inference_mode()
def read_pages(model: OCRModel, embeds: list[torch.Tensor], max_tokens: int = 256, prefill=None) -> list[str]:
    """Greedy read-out of image embeddings [N, D] (already laid out) with the default prompt; `prefill`:
    a copy of the decoder at the prompts' precision, as a pipeline serves it."""
    prompt = model.prompt_ids(reading_prompt(model))
    gen = Generator(model.decoder, slots=len(embeds), eos_id=model.tokens.eos,
                    rule=RepetitionRule(exempt=frozenset(model.tokens.td)), prefill=prefill)
    inputs = [model.decoder.build_inputs(e, prompt, model.tokens.bos) for e in embeds]
    return [model.detokenize(s.tokens) for s in gen.generate(inputs, [max_tokens] * len(inputs))]


def read_as_served(pipe, images, through_codes: bool, max_tokens: int = 512, batch: int = 16) -> list[str]:
    """What the service reads from page images, in process: a pipeline's towers, then its quantizer's codes
    (`through_codes`: exactly what /encode then /decode compute) or not, then greedy reading with the
    prompts prefilled at the pipeline's precision."""
    model, hyps = pipe.model, []
    dtype = model.decoder.lm_head.weight.dtype
    for i in range(0, len(images), batch):
        with torch.inference_mode():
            feats = model.encoder.encode_images(images[i:i + batch], pipe.mode)
            if through_codes:
                feats = pipe.quantizer.decode(pipe.quantizer.encode(feats))
        hyps += read_pages(model, [model.decoder.layout_image(f.to(dtype)) for f in feats], max_tokens, pipe.prefill_decoder)
    return hyps


def evaluate(model: OCRModel, pages, mode: str, batch: int = 16, quantizer=None, max_tokens: int = 256) -> dict:
    """CER/WER of greedy reading, uncompressed or through the quantizer's codes."""
    hyps = []
    for i in range(0, len(pages), batch):
        chunk = pages[i:i + batch]
        feats = model.encoder.encode_images([p.image for p in chunk], mode)
        with torch.inference_mode():
            if quantizer is not None:
                feats = quantizer.decode(quantizer.encode(feats))
        hyps += read_pages(model, [model.decoder.layout_image(f) for f in feats], max_tokens)
    cers = [cer(h, p.text) for h, p in zip(hyps, pages)]
    return {"cer": float(np.mean(cers)), "wer": float(np.mean([wer(h, p.text) for h, p in zip(hyps, pages)])),
            "pages": len(pages), "hyps": hyps, "cers": cers}


@torch.no_grad()
def slot_accuracy(feats: torch.Tensor, order_head, pages, grid: int, slots: int, charset: str,
                  bottleneck=None, shift: float = 0.0, lines: int = 1) -> float:
    """Share of occupied reading-order slots the order head reads right from the pages' tower features (the
    encoder stage's metric), through the bottleneck's codes when there is one."""
    if bottleneck is not None:
        feats = bottleneck.decode(bottleneck.encode(feats))
    pred = order_head(feats).reshape(*feats.shape[:2], slots, -1).argmax(-1)
    target = torch.from_numpy(np.stack([order_targets(p, grid, slots, charset, shift, lines) for p in pages])).to(pred.device)
    occupied = target != len(charset)
    return float((pred == target)[occupied].float().mean())
