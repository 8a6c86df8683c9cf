"""Training losses of a reader: the decoder's teacher-forced cross-entropy of the page text given the
image embeddings, and the targets of the towers' dense per-token losses."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ocr_latent.checkpoint import OCRModel
from ocr_latent.decoder import Decoder, rope
from ocr_latent.training.nano import FREE_PROMPT
from ocr_latent.training.pages import CHARSET, line_of_boxes, token_cell


def reading_prompt(model: OCRModel) -> str:
    """The prompt a model is trained and evaluated with: nano's own, else DeepSeek-OCR's free OCR."""
    return model.config.get("ocr_latent", {}).get("prompt", FREE_PROMPT)


def teacher_forced_loss(model: OCRModel, image_embeds: list[torch.Tensor], texts: list[str],
                        token_dropout: float = 0.0, pointers: list["Pointer"] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Mean cross-entropy of the page text (and EOS) given BOS + image + prompt, as the decoder reads it,
    and with `pointers` the mean of their pointer losses in the same forward (else None).
    token_dropout replaces that share of the *input* text tokens by the pad token: a decoder that
    cannot lean on its own language model has to read the image (against posterior collapse)."""
    with AttentionTap(model.decoder, {layer for p in pointers for layer, _ in p.heads}) as tap:
        logits, target = teacher_forced_logits(model, image_embeds, texts, token_dropout)
    text = F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=-100)
    return text, torch.stack([pointer_loss(tap, p, target) for p in pointers]).mean() if pointers else None


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
    logits = model.decoder(embeds)
    return logits, target.to(logits.device)


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


AT_BOS = -2  # a pointer target: the BOS position, where a head looks when what it points at is not there


def char_cells(page, grid: int, shift: float = 0.0, charset: str = CHARSET, second_lines: bool = False) -> list[int]:
    """The vision token (row-major; token_cell, `shift` as there) that each character of page.text lies in,
    in order: where a decoder writing that character should look. -1 for spaces, line breaks and characters
    outside the charset, which no token shows. With `second_lines`, only the characters of a text line that is
    not the first met in their token (reading order: the lower of two lines sharing a token) keep their token;
    the others look at BOS (AT_BOS)."""
    boxes, lines, met, cells = iter(page.char_boxes), iter(line_of_boxes(page)), {}, []
    for ch in page.text:
        box, line = (None, None) if ch in " \n" else (next(boxes), next(lines))
        if box is None or box[0] not in charset:
            cells.append(-1)
            continue
        cell = token_cell(page, box, grid, shift)
        first = met.setdefault(cell, line)  # the first text line met in the cell
        cells.append(cell if not second_lines or line != first else AT_BOS)
    return cells


class AttentionTap:
    """The queries and keys of some decoder layers' attention, kept as a forward runs (hooks on q_proj and
    k_proj), so a loss can read chosen heads' attention without a second forward or a change to the model."""

    def __init__(self, decoder: Decoder, layers: set[int]):
        self.decoder, self.q, self.k = decoder, {}, {}
        attn = [decoder.layers[i].self_attn for i in sorted(layers)]
        self.hooks = [proj.register_forward_hook(lambda _m, _i, out, i=i, store=store: store.__setitem__(i, out))
                      for i, a in zip(sorted(layers), attn) for proj, store in ((a.q_proj, self.q), (a.k_proj, self.k))]

    def __enter__(self) -> "AttentionTap":
        return self

    def __exit__(self, *exc) -> None:
        for hook in self.hooks:
            hook.remove()

    def log_attention(self, layer: int, head: int, row: int, queries: torch.Tensor) -> torch.Tensor:
        """[len(queries), T] fp32 log-probabilities of head `head` of layer `layer`, at positions `queries` of
        sequence `row`, over that sequence's positions (causal, RoPE as the decoder applies it)."""
        d = self.decoder.cfg.head_dim
        q = self.q[layer][row, :, head * d:(head + 1) * d].float()
        k = self.k[layer][row, :, head * d:(head + 1) * d].float()
        cos, sin = self.decoder.rope_tables(q.device)
        T = k.shape[0]
        q = rope(q[queries], cos[queries], sin[queries])
        k = rope(k, cos[:T], sin[:T])
        scores = (q @ k.T) * d ** -0.5
        later = torch.arange(T, device=q.device)[None] > queries[:, None]
        return scores.masked_fill(later, float("-inf")).log_softmax(-1)


@dataclass
class Pointer:
    """What the pointer loss guides: heads (layer, head) and, for each page of a batch, char_cells of its text."""
    heads: list[tuple[int, int]]
    cells: list[list[int]]
    grid: int


def pointer_targets(pointer: Pointer, target: torch.Tensor, row: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(query positions, key positions) of sequence `row`: each text position that predicts a character some
    token shows, and that token's position in the decoder's input (after BOS, rows of `grid` tokens and a
    newline each: Decoder.layout_image), or BOS's (0) for a target AT_BOS."""
    scored = (target[row] != -100).nonzero().flatten()  # the positions predicting text[0], text[1], ..., EOS
    if len(scored) != len(pointer.cells[row]) + 1:
        raise ValueError(f"pointer targets need one text token per character: the tokenizer wrote {len(scored) - 1} "
                         f"tokens for {len(pointer.cells[row])} characters (characters outside its charset?)")
    cells = torch.tensor(pointer.cells[row], dtype=torch.long, device=target.device)
    aimed = (cells >= 0) | (cells == AT_BOS)
    queries, cells = scored[:len(cells)][aimed], cells[aimed]
    return queries, torch.where(cells == AT_BOS, 0, 1 + (cells // pointer.grid) * (pointer.grid + 1) + cells % pointer.grid)


def pointer_loss(tap: AttentionTap, pointer: Pointer, target: torch.Tensor) -> torch.Tensor:
    """Mean -log of the attention each guided head gives, at each text position, to its target: the vision token
    showing the character that position predicts (or BOS, AT_BOS). Reading is a pointer moving along the rows of
    tokens, which a decoder otherwise finds by itself in one late head (bench/pointer_heads.py); the towers'
    targets say where every character is, so chosen heads can be told."""
    losses = []
    for row in range(target.shape[0]):
        queries, keys = pointer_targets(pointer, target, row)
        if len(queries):
            for layer, head in pointer.heads:
                logp = tap.log_attention(layer, head, row, queries)
                losses.append(-logp[torch.arange(len(keys), device=keys.device), keys])
    return torch.cat(losses).mean() if losses else torch.zeros((), device=target.device)


def pointer_accuracy(tap: AttentionTap, pointer: Pointer, target: torch.Tensor) -> float:
    """Share of the guided positions (over all guided heads) whose head attends most to its target."""
    right = total = 0
    for row in range(target.shape[0]):
        queries, keys = pointer_targets(pointer, target, row)
        for layer, head in pointer.heads if len(queries) else ():
            right += int((tap.log_attention(layer, head, row, queries).argmax(-1) == keys).sum())
            total += len(keys)
    return right / max(1, total)
