import dataclasses
import hashlib
import random
from pathlib import Path

import numpy as np
import pytest

from ocr_latent.training import pages
from ocr_latent.training.losses import order_targets

CLEAN = dataclasses.replace(pages.PageSpec(), augment=False)


@pytest.fixture(scope="module")
def docs():
    return pages.load_corpus()


@pytest.fixture(scope="module")
def sample_pages(docs):
    # Augmented pages from every split's stream type; 40 pages keep the file well under a second or two.
    return [pages.PageStream(docs, seed=3)[i] for i in range(40)]


def test_charset_is_printable_ascii():
    assert pages.CHARSET[0] == " " and pages.CHARSET[-1] == "~" and len(pages.CHARSET) == 95


def test_corpus_is_big_ascii_and_hashed(docs):
    assert len(docs) >= 20
    assert sum(len(d.text) for d in docs) >= 300_000
    root = pages.ROOT / "corpus"
    for d in docs:
        assert d.sha256 == hashlib.sha256((root / f"{d.name}.txt").read_bytes()).hexdigest()
        assert set(d.text) <= set(pages.CHARSET) | {"\n"}
        assert len(d.text.split()) > 200, d.name


def test_train_only_documents_are_more_text_and_share_none_with_the_held_out_pages(docs):
    """corpus/train-only (the standard library's docstrings) more than doubles the training text of ordinary
    pages, is never split into validation or test, and repeats no passage of the held-out documents."""
    extra = pages.train_only_documents()
    split = pages.split_documents(docs)
    assert sum(len(d.text) for d in extra) > 1.5 * sum(len(d.text) for d in split["train"])
    assert all(set(d.text) <= set(pages.CHARSET) | {"\n"} for d in extra)
    assert not {d.name for d in extra} & {d.name for d in docs}
    blob = "\n".join(d.text for d in extra)
    for held_out in split["val"] + split["test"]:
        passages = [held_out.text[i:i + 60] for i in range(0, len(held_out.text) - 60, 60)]
        assert not any(passage in blob for passage in passages), held_out.name
    assert "Return" in blob and len(blob.split()) > 100_000  # prose, not code


def test_split_disjoint_covering_deterministic(docs):
    split = pages.split_documents(docs, seed=0)
    names = {k: {d.name for d in v} for k, v in split.items()}
    assert set(names) == {"train", "val", "test"}
    assert not (names["train"] & names["val"] or names["train"] & names["test"] or names["val"] & names["test"])
    assert names["train"] | names["val"] | names["test"] == {d.name for d in docs}
    assert len(names["val"]) >= 2 and len(names["test"]) >= 2
    assert len(names["train"]) >= 0.7 * len(docs)
    assert pages.split_documents(list(reversed(docs)), seed=0) == split  # input order does not matter
    # Versions of one licence are near-duplicates and must not straddle splits.
    gpl_splits = {k for k, v in names.items() if v & {"license-gpl-1", "license-gpl-2", "license-gpl-3"}}
    assert len(gpl_splits) == 1
    manifest = pages.sources_manifest(split)
    assert len(manifest) == len(docs) and {m["split"] for m in manifest} == {"train", "val", "test"}
    assert set(manifest[0]) == {"name", "sha256", "split", "chars"}


def test_stream_is_pure_function_of_seed_and_index(docs):
    a, b = pages.PageStream(docs, seed=11), pages.PageStream(docs, seed=11)
    for i in (0, 7):
        assert a[i].image.tobytes() == b[i].image.tobytes() and a[i].text == b[i].text
    assert a[7].image.tobytes() == a[7].image.tobytes()  # re-reading an index does not drift
    assert a[0].text != a[1].text and a[0].image.tobytes() != a[1].image.tobytes()
    assert pages.PageStream(docs, seed=12)[0].text != a[0].text
    finite = pages.PageStream(docs, seed=11, length=2)
    assert len(finite) == 2 and [p.text for p in finite] == [a[0].text, a[1].text]
    with pytest.raises(IndexError):
        finite[2]


def test_render_page_accepts_seed_or_rng(docs):
    text = docs[0].text
    p1, p2 = pages.render_page(5, text, CLEAN), pages.render_page(random.Random(5), text, CLEAN)
    assert p1.text == p2.text and p1.image.tobytes() == p2.image.tobytes()


def test_page_invariants(sample_pages):
    for p in sample_pages:
        assert p.image.mode == "RGB" and p.image.size == (512, 512)
        assert 3 <= len(p.lines) <= 6 and p.text == "\n".join(p.lines)
        assert all(0 < len(line) <= 30 and line == line.strip() for line in p.lines)
        assert set(p.text) <= set(pages.CHARSET) | {"\n"}
        assert p.font in {"DejaVuSans", "DejaVuSans-Bold", "DejaVuSerif", "DejaVuSerif-Bold"}
        assert p.source
        non_space = [ch for ch in p.text if ch not in " \n"]
        assert [b[0] for b in p.char_boxes] == non_space
        for _, x0, y0, x1, y1 in p.char_boxes:
            assert 0 <= x0 < x1 <= 512 and 0 <= y0 < y1 <= 512
            assert x1 <= 512 - 16 and y1 <= 512 - 16  # text stays inside the minimum margins


def test_char_targets_mark_every_character(sample_pages):
    for grid in (8, 16):
        for p in sample_pages[:10]:
            t = pages.char_targets(p, grid)
            assert t.shape == (grid * grid, len(pages.CHARSET)) and t.dtype == np.float32
            marked = {pages.CHARSET[k] for k in np.nonzero(t.any(axis=0))[0]}
            assert marked == set(p.text) - {" ", "\n"}
            assert t[:, pages.CHARSET.index(" ")].sum() == 0


def test_char_target_cell_is_box_centre():
    page = pages.Page(image=pages.Image.new("RGB", (512, 512)), text="A", lines=["A"],
                      char_boxes=[("A", 100, 300, 120, 330)], font="DejaVuSans", font_size=24, source="x")
    t = pages.char_targets(page, 4)  # 128 px cells: centre (110, 315) -> row 2, col 0
    assert np.argwhere(t).tolist() == [[2 * 4 + 0, pages.CHARSET.index("A")]]


def test_field_targets_give_a_glyph_low_in_its_square_to_the_token_below():
    """The middle of what a token's convs see lies 3/8 of a square above and left of its square's: a glyph
    centred in a square's last 3/8 is the next token's target (pages.FIELD_SHIFT), others stay."""
    boxes = [("A", 20, 300, 40, 330), ("B", 20, 360, 40, 380), ("C", 210, 100, 240, 120)]
    page = pages.Page(image=pages.Image.new("RGB", (512, 512)), text="A\nB C", lines=["A", "B C"],
                      char_boxes=boxes, font="DejaVuSans", font_size=24, source="x")
    # 128 px squares (3/8: 48 px): A's centre (30, 315) is 59 px into row 2 and stays; B's (30, 370) is 114 px
    # into it (row 3); C's (225, 110) 97 px into column 1 and 110 px into row 0 (column 2, row 1)
    cells = [pages.token_cell(page, box, 4, pages.FIELD_SHIFT) for box in boxes]
    assert cells == [2 * 4 + 0, 3 * 4 + 0, 1 * 4 + 2]
    assert [pages.token_cell(page, box, 4) for box in boxes] == [2 * 4 + 0, 2 * 4 + 0, 0 * 4 + 1]
    t = order_targets(page, 4, 2, pages.CHARSET, pages.FIELD_SHIFT)
    assert [pages.CHARSET[t[c, 0]] for c in cells] == ["A", "B", "C"]


def test_on_lines_gives_a_lines_glyphs_one_middle_and_keeps_a_turned_lines_slope(docs):
    """on_lines moves each glyph's box onto its line's middle (a straight line through the glyphs'
    centres), so the glyphs of a line fall in one token row whatever their shapes."""
    upright = pages.PageStream(docs, CLEAN, seed=4)[0]
    lined = pages.on_lines(upright)
    assert [b[0] for b in lined.char_boxes] == [b[0] for b in upright.char_boxes]
    centres = [(b[2] + b[4]) / 2 for b in lined.char_boxes]
    start = 0
    for line in upright.lines:
        n = len(line) - line.count(" ")
        own = [(b[2] + b[4]) / 2 for b in upright.char_boxes[start:start + n]]
        if n > 2:  # one middle (the fit's slope over a line's length: a pixel or two), theirs spread by shape
            assert np.ptp(centres[start:start + n]) < 3.0 and np.ptp(own) > 3 * np.ptp(centres[start:start + n])
        assert abs(np.mean(centres[start:start + n]) - np.mean(own)) < 1e-6  # at the glyphs' mean
        start += n
    turned = pages.PageStream(docs, dataclasses.replace(CLEAN, max_rotation=1.5), seed=5)[0]
    first = pages.on_lines(turned).char_boxes[:len(turned.lines[0]) - turned.lines[0].count(" ")]
    xs, ys = np.array([(b[1] + b[3]) / 2 for b in first]), np.array([(b[2] + b[4]) / 2 for b in first])
    assert np.allclose(ys, np.polyval(np.polyfit(xs, ys, 1), xs), atol=1e-6)  # on one straight line
    assert abs(np.polyfit(xs, ys, 1)[0]) > 0.005  # sloped as the page was turned (tan 1.5 deg = 0.026 at most)


def test_slot_groups_by_text_line_start_each_line_of_a_token_at_its_own_slot():
    """With lines=2 a token's slots are two groups: the first text line met in its square fills the first,
    later lines the second, so where a line starts does not hang on how many glyphs the line above left."""
    from ocr_latent.training.losses import lines_held, order_targets, slot_positions

    # one 128 px square (grid 4, cell 0) holding three short lines: "AB", "C", "DE"
    boxes = [("A", 10, 10, 30, 30), ("B", 40, 10, 60, 30), ("C", 10, 50, 30, 70), ("D", 10, 90, 30, 110),
             ("E", 40, 90, 60, 110)]
    page = pages.Page(image=pages.Image.new("RGB", (512, 512)), text="AB\nC\nDE", lines=["AB", "C", "DE"],
                      char_boxes=boxes, font="DejaVuSans", font_size=24, source="x")
    read = lambda t: "".join("." if k == len(pages.CHARSET) else pages.CHARSET[k] for k in t[0])
    assert read(order_targets(page, 4, 6)) == "ABCDE." == read(order_targets(page, 4, 6, lines=1))
    assert read(order_targets(page, 4, 6, lines=2)) == "AB.CDE"  # later lines share the last group
    assert read(order_targets(page, 4, 6, lines=3)) == "ABC.DE"
    assert read(order_targets(page, 4, 4, lines=2)) == "ABCD"  # a group's slots run out: E has none
    assert [slot for _, _, slot in slot_positions(page, 4, 4, lines=2)] == [0, 1, 2, 3]
    assert lines_held(page, 4)[0] == 3 and lines_held(page, 4)[1:].sum() == 0
    assert lines_held(page, 4, charset="AB")[0] == 1  # only the characters read count


def test_glyphs_on_a_rows_edge_are_counted_on_the_side_the_token_head_reads_them():
    """across_edges moves the glyphs within the slack of an edge between token rows just across it, and
    tower_accuracy's either_side_target keeps, column by column, the side the head reads with fewer errors."""
    import torch

    from bench.tower_accuracy import either_side_target

    # 64 px squares: "A" and "B" centred 2 px into row 1 (columns 0 and 1; the slack, 8 px, moves them up
    # into row 0), "C" in row 2's middle, "D" 4 px above row 4 (column 3; moves down into it)
    centres = (("A", 10, 66), ("B", 80, 66), ("C", 10, 160), ("D", 200, 252))
    boxes = [(ch, x - 8, y - 10, x + 8, y + 10) for ch, x, y in centres]
    page = pages.Page(image=pages.Image.new("RGB", (1024, 1024)), text="A B\nC\nD", lines=["A B", "C", "D"],
                      char_boxes=boxes, font="DejaVuSans", font_size=20, source="x")
    across, moved = pages.across_edges(page, 16, 0.0, 8 / 64)
    assert moved == [0, 1, 3]
    assert [pages.token_cell(page, b, 16) for b in boxes] == [16, 17, 32, 51]
    assert [pages.token_cell(across, b, 16) for b in across.char_boxes] == [0, 1, 32, 67]
    assert pages.across_edges(page, 16, 0.0, 0.0) == (page, [])  # no slack: nothing moves

    # the head reads "A" in row 0, "B" and "C" where they fall, and misreads "D" on both sides
    empty, code = len(pages.CHARSET), pages.CHARSET.index
    read = torch.full((256, 2), empty)
    read[0, 0], read[17, 0], read[32, 0], read[51, 0] = code("A"), code("B"), code("C"), code("x")
    strict = torch.from_numpy(order_targets(page, 16, 2))
    target = either_side_target(page, read, strict, pages.CHARSET, 0.0, 8 / 64, 1)
    occupied = (target[:, 0] != empty).nonzero().flatten().tolist()
    assert [(c, pages.CHARSET[int(target[c, 0])]) for c in occupied] == [(0, "A"), (17, "B"), (32, "C"), (51, "D")]
    right = lambda t: int(((read == t) & (t != empty)).sum())
    assert (right(strict), right(target)) == (2, 3)


def test_clean_page_has_plain_background_and_boxes_cover_ink(docs):
    stream = pages.PageStream(docs, CLEAN, seed=4)
    for i in range(5):
        p = stream[i]
        assert p.augmentations == []
        pixels = np.asarray(p.image).astype(int)
        for x, y in ((0, 0), (511, 0), (0, 511), (511, 511)):
            assert tuple(pixels[y, x]) == p.background
        # Every clearly inked pixel lies in some character box (1 px slack for antialiasing).
        ink = np.abs(pixels - np.array(p.background)).max(axis=2) > 64
        covered = np.zeros_like(ink)
        for _, x0, y0, x1, y1 in p.char_boxes:
            covered[max(0, y0 - 1):y1 + 1, max(0, x0 - 1):x1 + 1] = True
        assert ink.any() and not (ink & ~covered).any()
        # ...and every box contains ink.
        assert all(ink[y0:y1, x0:x1].any() for _, x0, y0, x1, y1 in p.char_boxes)


def test_wide_text_still_fits():
    p = pages.render_page(0, "MWMWMWMWMWMWMWMWMWMWMWMWMWMWMW " * 50, CLEAN)  # 30-char capital words
    assert max(b[3] for b in p.char_boxes) <= 512 - 16 and 3 <= len(p.lines) <= 6


def test_the_curriculum_toward_ordinary_pages_shrinks_the_text_then_is_the_nano2_mix(docs):
    """Level 0 starts where v1 reads (40-56 px text in v1's fonts, upright, evenly lit), each level's text is
    smaller and more photo-like, and the last level is NANO2_PAGES itself; every page's lines fit it."""
    from ocr_latent.training.pages import NANO2_PAGES, toward_ordinary
    sizes, specs = [], []
    for level in range(8):
        mix = toward_ordinary(level)
        spec = mix.specs[0]
        sizes.append((spec.min_font_size, spec.max_font_size))
        specs.append(spec)
        stream = pages.PageStream(docs, mix, seed=0)
        for page in (stream[i] for i in range(3)):
            assert page.text and all(0 <= b[1] < b[3] <= page.image.size[0] for b in page.char_boxes)
    assert sizes[0] == (40, 56) and all(a > b for a, b in zip(sizes, sizes[1:]))
    assert specs[0].max_rotation == specs[0].shade_prob == 0 and specs[0].fonts == pages.SMALL.fonts
    assert 0 < specs[7].max_rotation < pages.ORDINARY.max_rotation and specs[7].fonts == pages.ORDINARY.fonts
    assert toward_ordinary(8) is NANO2_PAGES and toward_ordinary(19) is NANO2_PAGES


def test_closer_lines_put_more_lines_in_a_shared_token_row_at_the_same_glyph_size(docs):
    """level0-close is level 0 with its lines closer: the same text sizes and small pages, and more of its lines
    share a row of vision tokens with another line (the tokens holding two lines)."""
    level0, close = pages.toward_ordinary(0), pages.PAGE_KINDS["level0-close"]
    assert close.specs[1:] == level0.specs[1:] and close.weights == level0.weights
    shares, sizes = [], []
    for spec in (level0.specs[0], close.specs[0]):
        stream = pages.PageStream(docs, spec, seed=4)
        flags = [f for i in range(24) for f in pages.lines_sharing_a_row(stream[i])]
        shares.append(sum(flags) / len(flags))
        sizes.append(sorted(stream[i].font_size for i in range(24)))
    assert shares[1] > 1.6 * shares[0] and shares[1] > 0.25, shares
    assert all(40 <= s <= 56 for s in sizes[1][:3] + sizes[1][-3:]), sizes


def test_a_machine_without_the_fonts_is_told_how_to_get_them(tmp_path):
    with pytest.raises(FileNotFoundError, match="install Debian's fonts-dejavu, or set OCR_LATENT_FONT_DIR"):
        pages.render_page(0, "a page of text " * 20, dataclasses.replace(pages.SMALL, font_dir=str(tmp_path),
                                                                         fonts=("DejaVuSans-Missing.ttf",)))
