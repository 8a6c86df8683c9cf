"""Training losses of a reader: the decoder's teacher-forced cross-entropy of the page text given the
image embeddings, and the targets of the towers' dense per-token losses."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from ocr_latent.checkpoint import OCRModel
from ocr_latent.training.nano import FREE_PROMPT
from ocr_latent.training.pages import CHARSET, line_of_boxes, token_cell


def reading_prompt(model: OCRModel) -> str:
    """The prompt a model is trained and evaluated with: nano's own, else DeepSeek-OCR's free OCR."""
    return model.config.get("ocr_latent", {}).get("prompt", FREE_PROMPT)


def teacher_forced_loss(model: OCRModel, image_embeds: list[torch.Tensor], texts: list[str],
                        token_dropout: float = 0.0) -> torch.Tensor:
    """Mean cross-entropy of the page text (and EOS) given BOS + image + prompt, as the decoder reads it.
    token_dropout replaces that share of the *input* text tokens by the pad token: a decoder that
    cannot lean on its own language model has to read the image (against posterior collapse)."""
    logits, target = teacher_forced_logits(model, image_embeds, texts, token_dropout)
    return F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=-100)


def teacher_forced_logits(model: OCRModel, image_embeds: list[torch.Tensor], texts: list[str],
                          token_dropout: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [B, T, V] of the decoder reading BOS + image + prompt + text, and the targets [B, T]
    (the next text token, -100 where nothing is scored)."""
    prompt = model.prompt_ids(reading_prompt(model))
    inputs, targets = [], []
    for emb, text in zip(image_embeds, texts):
        ids = model.tokenizer.encode(text, add_special_tokens=False).ids + [model.tokens.eos]
        given = ids[:-1]
        if token_dropout:
            keep = torch.rand(len(given)) >= token_dropout
            given = [t if k else model.tokens.pad for t, k in zip(given, keep.tolist())]
        x = model.decoder.build_inputs(emb, prompt + given, model.tokens.bos)
        inputs.append(x)
        # position p predicts token p+1; only the text positions are scored
        targets.append(torch.tensor([-100] * (x.shape[0] - len(ids)) + ids))
    T = max(x.shape[0] for x in inputs)
    embeds = torch.stack([F.pad(x, (0, 0, 0, T - x.shape[0])) for x in inputs])
    target = torch.stack([F.pad(t, (0, T - t.shape[0]), value=-100) for t in targets])
    return model.decoder(embeds), target


def slot_positions(page, grid: int, slots: int, charset: str = CHARSET, shift: float = 0.0, lines: int = 1):
    """(box, cell, slot) for each character of the charset that has a slot: the cell its centre lies in
    (token_cell, `shift` as there), the cell's slots filled in reading order (the renderer lists boxes
    line by line, left to right); characters past a cell's last slot have none. With `lines` > 1 the slots
    are that many groups: the first lines-1 text lines met in a cell get a group each, any further ones
    share the last, so where a line's characters start in a cell does not hang on how many the line above
    left in it."""
    per = slots // lines
    met: dict[int, list[int]] = {}  # cell -> the text lines met in it
    fill: dict[tuple[int, int], int] = {}
    for box, line in zip(page.char_boxes, line_of_boxes(page)):
        if box[0] not in charset:
            continue
        cell = token_cell(page, box, grid, shift)
        seen = met.setdefault(cell, [])
        if line not in seen:
            seen.append(line)
        group = min(seen.index(line), lines - 1)
        taken = fill.get((cell, group), 0)
        if taken < (per if group < lines - 1 else slots - group * per):
            yield box, cell, group * per + taken
            fill[cell, group] = taken + 1


def order_targets(page, grid: int, slots: int = 6, charset: str = CHARSET, shift: float = 0.0,
                  lines: int = 1) -> np.ndarray:
    """[grid*grid, slots] class ids: the characters whose centre lies in each cell, in reading
    order (slot_positions, `lines` as there); len(charset) marks an empty slot. Unlike char_targets it
    tells each vision token what it shows *in order*."""
    index = {ch: k for k, ch in enumerate(charset)}
    out = np.full((grid * grid, slots), len(charset), dtype=np.int64)
    for box, cell, slot in slot_positions(page, grid, slots, charset, shift, lines):
        out[cell, slot] = index[box[0]]
    return out


def lines_held(page, grid: int, charset: str = CHARSET, shift: float = 0.0) -> np.ndarray:
    """[grid*grid] how many text lines have a character of the charset centred in each cell (token_cell,
    `shift` as there)."""
    held = [set() for _ in range(grid * grid)]
    for box, line in zip(page.char_boxes, line_of_boxes(page)):
        if box[0] in charset:
            held[token_cell(page, box, grid, shift)].add(line)
    return np.array([len(lines) for lines in held])
