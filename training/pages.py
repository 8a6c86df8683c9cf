"""Rendered-page data: exact ground-truth text and character boxes on synthetic document images.

A page is a run of prose drawn with Pillow in a DejaVu font on a tinted background, optionally
degraded by rotation, shading, noise, blur and JPEG. `SMALL` pages (3-6 lines of at most 30
characters on 512x512, ASCII) are what nano v1 reads; `ORDINARY` pages are what a user tries first
(1024x1024, letter and A4 shapes, 8-24 lines of 30-70 characters at 18-40 px, Latin-1 words mixed in).
Everything is a pure function of a seed, so `PageStream(docs, spec, seed)[i]` is the same page on
every machine and run; training can resume at any step and held-out pages stay fixed.

Text comes from the plain-text documents in `corpus/` (see corpus/SOURCES.md). Documents, not
pages, are split into train/val/test so held-out pages never share a source text with training.
"""
from __future__ import annotations

import hashlib
import io
import math
import os
import random
import re
import textwrap
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter, ImageFont

from ocr_latent.architecture import ROOT

CHARSET = "".join(chr(code) for code in range(ord(" "), ord("~") + 1))  # the 95 printable ASCII characters
# the printable Latin-1 supplement (U+00A1..U+00FF) without the soft hyphen, which renders as nothing
LATIN1 = "".join(chr(code) for code in range(0xA1, 0x100) if code != 0xAD)
CHARSET_LATIN1 = CHARSET + LATIN1
# Real words and names that need Latin-1 letters, mixed into the (ASCII) corpus text of some pages so
# the towers and decoder see every such letter in plausible company; see latin1_words().
LATIN1_WORDS = """
über Straße Grüße Müller schön Mädchen Bär Öffnung Übung Gebäude größer fährt Käse Brücke Fußball
Tür für Löwe Häuser Glück Gödel Dürer Köln München Zürich Düsseldorf Österreich Ärger ähnlich
café déjà vu élève hôtel garçon français Noël naïve façade crème brûlée résumé fiancée Genève
château forêt île où là-bas près très déçu éclair été à côté cœur Ça Québec Élise Hélène
niño año señor mañana España jalapeño piñata corazón canción pingüino ¿Qué? ¡Olé! Málaga Córdoba
São Paulo coração não irmã ação Lisboa João avó informação Brasília Ângela
smørrebrød Ærø Ålesund Øresund fjørd Ångström Tromsø Göteborg Malmö Åsa Þór Ísland Reykjavík
Þingvellir fjörður Eyjafjallajökull Færøerne Ðakovo
perché città più caffè università Niccolò Forlì
°C ±0.5 §12 £20 ¥300 ¢50 ©2024 ®TM µm ½ ¼ ¾ x² m³ ¹ × ÷ « » ¶ · ª º ¬ ¦ ¨ ¯ ´ ¸ ¤
""".split()
ACCENTED = {  # plain letter -> Latin-1 letters built on it, for accenting an ASCII word
    "a": "àáâãäå", "e": "èéêë", "i": "ìíîï", "o": "òóôõöø", "u": "ùúûü", "y": "ýÿ", "n": "ñ", "c": "ç",
    "A": "ÀÁÂÃÄÅ", "E": "ÈÉÊË", "I": "ÌÍÎÏ", "O": "ÒÓÔÕÖØ", "U": "ÙÚÛÜ", "Y": "Ý", "N": "Ñ", "C": "Ç",
    "s": "ß", "d": "ð", "D": "Ð", "t": "þ", "T": "Þ"}
# Debian's fonts-dejavu (fonts-dejavu-core + fonts-dejavu-extra: the condensed faces); elsewhere a folder of the same
# files named by OCR_LATENT_FONT_DIR (a GPU machine without them gets them carried in)
FONT_DIR = os.environ.get("OCR_LATENT_FONT_DIR", "/usr/share/fonts/truetype/dejavu")


@dataclass(frozen=True)
class Document:
    name: str  # file stem, e.g. "license-gpl-3"
    text: str
    sha256: str  # of the file bytes, so a training manifest pins exactly what was read


def load_corpus(root: str | Path = "corpus") -> list[Document]:
    """All `*.txt` documents under `root`, sorted by name. A relative root that does not exist in
    the working directory is looked up next to this module, so scripts work from any directory."""
    path = Path(root)
    if not path.is_absolute() and not path.is_dir():
        path = ROOT / path
    docs = []
    for file in sorted(path.glob("*.txt")):
        raw = file.read_bytes()
        text = raw.decode("ascii")
        if set(text) - set(CHARSET) - {"\n"}:
            raise ValueError(f"{file} has characters outside CHARSET; see corpus/make_corpus.py normalise()")
        docs.append(Document(file.stem, text, hashlib.sha256(raw).hexdigest()))
    if not docs:
        raise FileNotFoundError(f"no .txt documents in {path}")
    return docs


def _family(name: str) -> str:
    # Versions of one text ("license-gpl-2", "license-gpl-3") are near-duplicates; keeping them in
    # the same split stops held-out pages from being memorised from a sibling version.
    return re.sub(r"-[\d.]+$", "", name)


def train_only_documents(root: str | Path = "corpus") -> list[Document]:
    """The documents under `root`/train-only (the standard library's docstrings, corpus/SOURCES.md):
    rendered into training pages only (train.py --more-text), so the held-out pages stay as they are.
    A char-level decoder of ordinary pages reads ~1,000 characters a page, and over the 27 training
    documents alone it learns their phrases by heart and writes them where the towers are unsure."""
    return load_corpus(Path(root) / "train-only")


def training_documents(more_text: bool = False) -> list[Document]:
    """What training pages are drawn from: the corpus's train split, with the train-only documents when
    `more_text` (train.py base --more-text)."""
    return split_documents(load_corpus())["train"] + (train_only_documents() if more_text else [])


def split_documents(docs: list[Document], seed: int = 0) -> dict[str, list[Document]]:
    """Deterministic, disjoint train/val/test split by document (~80/10/10 by count, val and test
    at least 2 each). Versions of the same text stay together (see `_family`)."""
    families: dict[str, list[Document]] = {}
    for doc in sorted(docs, key=lambda d: d.name):
        families.setdefault(_family(doc.name), []).append(doc)
    order = sorted(families)
    random.Random(seed).shuffle(order)
    held_out_size = max(2, round(0.1 * len(docs)))
    split: dict[str, list[Document]] = {"train": [], "val": [], "test": []}
    for key in order:
        group = families[key]
        # Fill test, then val, with whole families that do not overshoot the target; rest is train.
        target = next((s for s in ("test", "val") if len(split[s]) + len(group) <= held_out_size), "train")
        split[target].extend(group)
    return {name: sorted(group, key=lambda d: d.name) for name, group in split.items()}


def sources_manifest(split: dict[str, list[Document]]) -> list[dict]:
    """One record per document, for writing next to a trained model."""
    return [{"name": d.name, "sha256": d.sha256, "split": name, "chars": len(d.text)}
            for name, docs in split.items() for d in docs]


@dataclass(frozen=True)
class PageSpec:
    size: int = 512  # square page, pixels
    min_lines: int = 3
    max_lines: int = 6
    min_chars_per_line: int = 20  # the wrap width is drawn per page from this range
    max_chars_per_line: int = 30
    fonts: tuple[str, ...] = ("DejaVuSans.ttf", "DejaVuSans-Bold.ttf", "DejaVuSerif.ttf", "DejaVuSerif-Bold.ttf")
    font_dir: str = FONT_DIR
    min_font_size: int = 22  # pixels (em size); shrunk within this range when a line would not fit
    max_font_size: int = 30
    min_margin: int = 16  # left/top margins are random in [min, max]; right/bottom are at least min
    max_margin: int = 48
    min_line_spacing: float = 1.1  # baseline-to-baseline distance as a multiple of the font size
    max_line_spacing: float = 1.6
    max_ink_grey: int = 60  # text grey level 0..60, each channel shifted by up to +-ink_tint
    ink_tint: int = 12
    min_paper_grey: int = 230  # background 230..255, each channel lowered by up to paper_tint
    paper_tint: int = 10
    augment: bool = True
    noise_prob: float = 0.4
    max_noise_sigma: float = 6.0  # gaussian pixel noise, in 0..255 units
    blur_prob: float = 0.3
    max_blur_radius: float = 0.8
    jpeg_prob: float = 0.4
    jpeg_quality: tuple[int, int] = (60, 95)
    # Ordinary pages. At their zero defaults nothing is drawn from the seed for them, so SMALL pages
    # (and every held-out set of them) stay exactly what they were before these fields existed.
    shapes: tuple[tuple[int, int], ...] = ()  # (width, height) drawn per page; () = size x size
    max_rotation: float = 0.0  # degrees, uniform in [-max, max]
    latin1_page_prob: float = 0.0  # share of pages with Latin-1 words mixed in ...
    latin1_word_prob: float = 0.0  # ... and the share of their words replaced
    shade_prob: float = 0.0  # uneven lighting: a linear brightness ramp across the page


SMALL = PageSpec()
ORDINARY = PageSpec(
    size=1024, shapes=((1024, 1024), (816, 1056), (794, 1123)), min_lines=8, max_lines=24,
    min_chars_per_line=30, max_chars_per_line=70,
    fonts=("DejaVuSans.ttf", "DejaVuSans-Bold.ttf", "DejaVuSerif.ttf", "DejaVuSerif-Bold.ttf",
           "DejaVuSansCondensed.ttf", "DejaVuSansCondensed-Bold.ttf", "DejaVuSerifCondensed.ttf",
           "DejaVuSerifCondensed-Bold.ttf"),
    min_font_size=18, max_font_size=40, min_margin=24, max_margin=120, paper_tint=25,
    max_rotation=1.5, latin1_page_prob=0.3, latin1_word_prob=0.12, shade_prob=0.3)
SMALL_LATIN1 = PageSpec(latin1_page_prob=0.3, latin1_word_prob=0.12)


@dataclass(frozen=True)
class PageMix:
    """Several page kinds in one stream: each page's kind is drawn with these weights."""
    specs: tuple[PageSpec, ...]
    weights: tuple[float, ...]


# What nano v2 trains on: mostly ordinary pages, and today's small pages so that it keeps reading them.
NANO2_PAGES = PageMix((ORDINARY, SMALL_LATIN1), (0.85, 0.15))


CURRICULUM_LEVELS = 8  # toward_ordinary's levels before NANO2_PAGES


def toward_ordinary(level: int, levels: int = CURRICULUM_LEVELS) -> PageMix:
    """A curriculum from what nano v1 reads to NANO2_PAGES (reached at `levels`). Level 0 is ordinary pages
    in v1's fonts at v1's glyph size (its 512 px pages at 22-30 px are 44-60 px in the view: here 40-56 px),
    upright and evenly lit; each level shrinks the text a step and brings in more of the photo-like:
    rotation and shading grow with the level, condensed faces join halfway. Fewer and shorter lines where
    large text would not fit. Today's small pages are 30 % of every level: the model keeps what it reads."""
    if level >= levels:
        return NANO2_PAGES
    t = level / levels
    low, high = round(40 - t * (40 - ORDINARY.min_font_size)), round(56 - t * (56 - ORDINARY.max_font_size))
    chars = min(ORDINARY.max_chars_per_line, 1700 // high)  # a line of DejaVu is about 0.55 em a character
    spec = replace(ORDINARY, min_font_size=low, max_font_size=high, min_chars_per_line=min(20, chars),
                   max_chars_per_line=chars, min_lines=4, max_lines=min(ORDINARY.max_lines, 900 // (high * 4 // 3)),
                   fonts=ORDINARY.fonts if t >= 0.5 else SMALL.fonts, max_rotation=t * ORDINARY.max_rotation,
                   shade_prob=t * ORDINARY.shade_prob)
    return PageMix((spec, SMALL_LATIN1), (0.7, 0.3))


def closer_lines(level: int) -> PageMix:
    """Curriculum level `level` with the lines of its ordinary pages set closer: a baseline pitch of 1.0-1.25 of the
    font size instead of 1.1-1.6, the glyphs the level's size. More lines then share a row of vision tokens with
    another line (at level 0 about 38 % of lines instead of 16 %), the tokens holding two lines that the towers read
    worst (docs/training.md); the level's small pages stay as they are."""
    mix = toward_ordinary(level)
    return replace(mix, specs=(replace(mix.specs[0], min_line_spacing=1.0, max_line_spacing=1.25), *mix.specs[1:]))


def level_pages(docs: list[Document], level: int | str, count: int, seed: int = 9) -> list[Page]:
    """The first `count` pages of stream `seed` of a curriculum level's own kind (not its mix: no small pages),
    or of v1's small pages for level "small": what train.py's --advance-at gate and bench/curriculum_levels.py
    read (seed 9)."""
    spec = SMALL if level == "small" else toward_ordinary(int(level)).specs[0]
    stream = PageStream(docs, spec, seed=seed)
    return [stream[i] for i in range(count)]


# by the name a command line gives; levelK: the curriculum's level K (its mix, small pages included);
# level0-close: level 0 with its lines closer (closer_lines)
PAGE_KINDS = {"small": SMALL, "ordinary": ORDINARY, "nano2": NANO2_PAGES,
              **{f"level{k}": toward_ordinary(k) for k in range(CURRICULUM_LEVELS)}, "level0-close": closer_lines(0)}


@dataclass
class Page:
    image: Image.Image  # RGB, size x size (or one of spec.shapes)
    text: str  # exact ground truth: lines joined with "\n"
    lines: list[str]
    char_boxes: list[tuple[str, int, int, int, int]]  # (char, x0, y0, x1, y1) for every non-space char
    font: str  # font file stem, e.g. "DejaVuSerif-Bold"
    font_size: int
    source: str  # document name
    ink: tuple[int, int, int] = (0, 0, 0)
    background: tuple[int, int, int] = (255, 255, 255)
    augmentations: list[str] = field(default_factory=list)


@lru_cache(maxsize=256)
def _font(path: str, size: int) -> ImageFont.FreeTypeFont:
    # BASIC layout (no libraqm shaping or ligatures): one glyph per character on every machine,
    # so per-character boxes are well defined and pages are identical wherever they are rendered.
    try:
        return ImageFont.truetype(path, size, layout_engine=ImageFont.Layout.BASIC)
    except OSError:
        raise FileNotFoundError(f"the page renderer's font {path} is not there: install Debian's fonts-dejavu, or set "
                                f"OCR_LATENT_FONT_DIR to a folder with the DejaVu fonts") from None


def _take_lines(words: list[str], n_lines: int, width: int, rng: random.Random) -> list[str]:
    # A line of `width` characters holds at most (width + 1) // 2 words, so n_lines * width words
    # always wrap to at least n_lines lines (unless the document is shorter than that).
    n_words = n_lines * width
    start = rng.randrange(max(1, len(words) - n_words + 1))
    span = " ".join(words[start:start + n_words])
    return textwrap.wrap(span, width, break_long_words=True)[:n_lines]


def latin1_words(words: list[str], share: float, rng: random.Random) -> list[str]:
    """`words` with about `share` of them replaced: mostly by a real Latin-1 word, else by the same
    word with one letter accented (so every Latin-1 letter turns up, not only those of the list)."""
    out = []
    for word in words:
        if rng.random() >= share:
            out.append(word)
        elif rng.random() < 0.7:
            out.append(rng.choice(LATIN1_WORDS))
        else:
            spots = [i for i, ch in enumerate(word) if ch in ACCENTED]
            i = rng.choice(spots) if spots else None
            out.append(word[:i] + rng.choice(ACCENTED[word[i]]) + word[i + 1:] if spots else word + rng.choice(LATIN1))
    return out


def render_page(rng_or_seed: random.Random | int | str, document_text: str,
                spec: PageSpec = PageSpec(), source: str = "") -> Page:
    """Render a random contiguous span of `document_text` as one page."""
    rng = rng_or_seed if isinstance(rng_or_seed, random.Random) else random.Random(rng_or_seed)
    words = document_text.split()
    if spec.latin1_page_prob and rng.random() < spec.latin1_page_prob:
        words = latin1_words(words, spec.latin1_word_prob, rng)
    page_w, page_h = rng.choice(spec.shapes) if spec.shapes else (spec.size, spec.size)
    avail_w, avail_h = page_w - 2 * spec.min_margin, page_h - 2 * spec.min_margin
    tries = 20
    for attempt in range(tries):  # retry with a new span when one is too wide even at min font size
        # ...and on the last try accept a smaller font rather than fail (e.g. an all-capitals text).
        smallest_size = spec.min_font_size if attempt < tries - 1 else 6
        lines = _take_lines(words, rng.randint(spec.min_lines, spec.max_lines),
                            rng.randint(spec.min_chars_per_line, spec.max_chars_per_line), rng)
        font_name = rng.choice(spec.fonts)
        font_size = rng.randint(spec.min_font_size, spec.max_font_size)
        spacing = rng.uniform(spec.min_line_spacing, spec.max_line_spacing)

        def measure():  # ink width of the widest line, block height, baseline pitch
            f = _font(f"{spec.font_dir}/{font_name}", font_size)
            ascent, descent = f.getmetrics()
            pitch = round(font_size * spacing)
            return f, max(f.getbbox(line)[2] for line in lines), pitch * (len(lines) - 1) + ascent + descent, pitch

        font, width, height, pitch = measure()
        while width > avail_w and font_size > smallest_size:
            font_size -= 1
            font, width, height, pitch = measure()
        while height > avail_h and len(lines) > spec.min_lines:
            lines.pop()
            font, width, height, pitch = measure()
        if len(lines) >= spec.min_lines and width <= avail_w and height <= avail_h:
            break
    else:
        raise ValueError(f"could not fit {source or 'document'} text on a {page_w}x{page_h}px page")

    left = rng.randint(spec.min_margin, min(spec.max_margin, page_w - spec.min_margin - width))
    top = rng.randint(spec.min_margin, min(spec.max_margin, page_h - spec.min_margin - height))
    grey = rng.randint(0, spec.max_ink_grey)
    ink = tuple(min(255, max(0, grey + rng.randint(-spec.ink_tint, spec.ink_tint))) for _ in range(3))
    paper = rng.randint(spec.min_paper_grey, 255)
    background = tuple(paper - rng.randint(0, spec.paper_tint) for _ in range(3))

    image = Image.new("RGB", (page_w, page_h), background)
    draw = ImageDraw.Draw(image)
    boxes = []
    for row, line in enumerate(lines):
        y = top + row * pitch
        draw.text((left, y), line, font=font, fill=ink)  # anchor "la": (x, y) is the left/ascender point
        for i, ch in enumerate(line):
            if ch == " ":
                continue
            # Pen position of ch inside the drawn line, including any kerning with the previous char.
            origin = left + font.getlength(line[:i + 1]) - font.getlength(ch)
            bx0, by0, bx1, by1 = font.getbbox(ch)
            boxes.append((ch, max(0, math.floor(origin + bx0)), max(0, y + by0),
                          min(page_w, math.ceil(origin + bx1)), min(page_h, y + by1)))

    applied = []
    if spec.max_rotation:
        angle = rng.uniform(-spec.max_rotation, spec.max_rotation)
        image, boxes = _rotate(image, boxes, angle, background)
        applied.append(f"rotate {angle:+.2f}")
    if spec.augment:
        image, more = _augment(image, spec, rng)
        applied += more
    return Page(image, "\n".join(lines), lines, boxes, Path(font_name).stem, font_size, source,
                ink, background, applied)


def _rotate(image: Image.Image, boxes: list, angle: float, fill) -> tuple[Image.Image, list]:
    """The page turned `angle` degrees counter-clockwise about its centre (a sheet slightly askew
    under a camera), and each character box replaced by the box around its turned corners."""
    w, h = image.size
    cx, cy, a = w / 2, h / 2, math.radians(angle)
    cos, sin = math.cos(a), math.sin(a)

    def turn(x, y):  # image y points down, so a counter-clockwise turn is this matrix
        return cx + (x - cx) * cos + (y - cy) * sin, cy - (x - cx) * sin + (y - cy) * cos

    turned = []
    for ch, x0, y0, x1, y1 in boxes:
        xs, ys = zip(*(turn(x, y) for x, y in ((x0, y0), (x1, y0), (x0, y1), (x1, y1))))
        turned.append((ch, max(0, math.floor(min(xs))), max(0, math.floor(min(ys))),
                       min(w, math.ceil(max(xs))), min(h, math.ceil(max(ys)))))
    return image.rotate(angle, Image.Resampling.BICUBIC, fillcolor=fill), turned


def _augment(image: Image.Image, spec: PageSpec, rng: random.Random) -> tuple[Image.Image, list[str]]:
    # Order follows a camera/scanner pipeline: optics blur, then sensor noise, then compression.
    applied = []
    if spec.shade_prob and rng.random() < spec.shade_prob:
        w, h = image.size
        direction, depth = rng.uniform(0, 2 * math.pi), rng.uniform(0.08, 0.25)
        yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
        ramp = (xx / w - 0.5) * math.cos(direction) + (yy / h - 0.5) * math.sin(direction)  # -0.7..0.7
        gain = 1.0 - depth * (ramp - ramp.min()) / max(1e-6, float(ramp.max() - ramp.min()))
        image = Image.fromarray(np.clip(np.asarray(image, np.float32) * gain[..., None], 0, 255).astype(np.uint8), "RGB")
        applied.append("shade")
    if rng.random() < spec.blur_prob:
        image = image.filter(ImageFilter.GaussianBlur(rng.uniform(0.3, spec.max_blur_radius)))
        applied.append("blur")
    if rng.random() < spec.noise_prob:
        noise_rng = np.random.default_rng(rng.getrandbits(64))
        pixels = np.asarray(image, dtype=np.float32)
        pixels += noise_rng.normal(0.0, rng.uniform(1.0, spec.max_noise_sigma), pixels.shape)
        image = Image.fromarray(np.clip(np.rint(pixels), 0, 255).astype(np.uint8), "RGB")
        applied.append("noise")
    if rng.random() < spec.jpeg_prob:
        buffer = io.BytesIO()
        image.save(buffer, "JPEG", quality=rng.randint(*spec.jpeg_quality))
        image = Image.open(io.BytesIO(buffer.getvalue())).convert("RGB")
        applied.append("jpeg")
    return image, applied


class PageStream:
    """Deterministic, indexable stream of pages: `stream[i]` depends only on (seed, i, documents,
    spec). Documents are drawn with probability proportional to sqrt(length): short texts are not
    over-repeated, yet one long text does not crowd out the rest of a small (val/test) split.
    Infinite unless `length` is given (e.g. a fixed benchmark set)."""

    def __init__(self, documents: list[Document], spec: PageSpec | PageMix = PageSpec(), seed: int = 0,
                 length: int | None = None):
        if not documents:
            raise ValueError("PageStream needs at least one document")
        self.documents = list(documents)
        self.spec, self.seed, self.length = spec, seed, length
        self._weights = [math.sqrt(len(d.text)) for d in self.documents]

    def __getitem__(self, index: int) -> Page:
        if index < 0 or (self.length is not None and index >= self.length):
            raise IndexError(index)
        rng = random.Random(f"pages:{self.seed}:{index}")  # str seeds hash via SHA-512: stable across runs
        doc = rng.choices(self.documents, weights=self._weights)[0]
        spec = rng.choices(self.spec.specs, weights=self.spec.weights)[0] if isinstance(self.spec, PageMix) else self.spec
        return render_page(rng, doc.text, spec, source=doc.name)

    def __len__(self) -> int:
        if self.length is None:
            raise TypeError("infinite PageStream has no length")
        return self.length

    def __iter__(self):
        index = 0
        while self.length is None or index < self.length:
            yield self[index]
            index += 1


def test_pages(n: int | None = None, seed: int = 2, spec: PageSpec | PageMix | None = None) -> PageStream:
    """The held-out pages: the test split's documents, clean (no augmentation) unless `spec` says
    otherwise; `n` pages (None: as many as asked for). seed=2 is the set training reports on."""
    return PageStream(split_documents(load_corpus())["test"], spec or PageSpec(augment=False), seed=seed, length=n)


test_pages.__test__ = False  # a helper, not a test, wherever tests import it


# A vision token sees its 64 px square of the view through the 3x3 conv of SAM's neck and two stride-2 3x3
# convs (net_2, net_3, padding 1): 64 px above and left of the square but only 16 px below and right, so the
# middle of what it sees lies 24 px (3/8 of the square) above and left of the square's. A glyph centred in
# the last 3/8 of a square is seen whole by the next token: with FIELD_SHIFT it is that token's target.
FIELD_SHIFT = 0.375


def view_centre(page: Page, box: tuple) -> tuple[float, float]:
    """The centre (x, y) of a character box in fractions of the letterboxed view (base mode scales the
    page to fit its view and centres it)."""
    _, x0, y0, x1, y1 = box
    w, h = page.image.size
    scale = 1.0 / max(w, h)  # page pixels -> view fractions
    return ((x0 + x1) / 2 + (max(w, h) - w) / 2) * scale, ((y0 + y1) / 2 + (max(w, h) - h) / 2) * scale


def token_cell(page: Page, box: tuple, grid: int, shift: float = 0.0) -> int:
    """The vision token (row-major, of grid x grid) whose square of the letterboxed view holds the
    centre of a character box (view_centre), or with `shift` (a fraction of a square) the token whose
    square starts that much above and left."""
    x, y = view_centre(page, box)
    return min(grid - 1, int(y * grid + shift)) * grid + min(grid - 1, int(x * grid + shift))


def line_of_boxes(page: Page) -> list[int]:
    """The text line (an index into page.lines) of each of the page's character boxes."""
    return [k for k, line in enumerate(page.lines) for ch in line if ch != " "]


def on_lines(page: Page) -> Page:
    """The page with each glyph's box moved up or down to centre on its line: a straight line fitted
    through the centres of the line's glyphs (turned pages' lines slope). A glyph's own ink centre
    wanders with its shape ("g", "T", "."), so a line whose middle lies near a token's edge would give
    some of its glyphs to one token and some to the next; on its line, a line's glyphs share a token row."""
    boxes, moved = page.char_boxes, []
    for line in page.lines:
        glyphs, boxes = boxes[:len(line) - line.count(" ")], boxes[len(line) - line.count(" "):]
        xs = np.array([(b[1] + b[3]) / 2 for b in glyphs])
        ys = np.array([(b[2] + b[4]) / 2 for b in glyphs])
        slope = np.polyfit(xs, ys, 1)[0] if len(glyphs) > 1 and np.ptp(xs) > 0 else 0.0
        middle = ys.mean() + slope * (xs - xs.mean()) if len(glyphs) else ys
        moved += [(ch, x0, y0 + dy, x1, y1 + dy) for (ch, x0, y0, x1, y1), dy in zip(glyphs, middle - ys)]
    return replace(page, char_boxes=moved)


# the two kinds of line lines_sharing_a_row tells apart, as the benches name them: LINE_KINDS[not shares]
LINE_KINDS = ("lines sharing a token row", "lines with a token row to themselves")


def lines_sharing_a_row(page: Page) -> list[bool]:
    """For each text line of a page, whether another line's middle lies in the same row of vision tokens (the rows
    as towers trained with --field-targets see them: FIELD_SHIFT)."""
    rows: list[list[int]] = [[] for _ in page.lines]  # each line's glyphs' token rows
    for box, line in zip(on_lines(page).char_boxes, line_of_boxes(page)):
        rows[line].append(token_cell(page, box, 16, FIELD_SHIFT) // 16)
    row = [max(set(r), key=r.count) if r else None for r in rows]
    return [r is not None and row.count(r) > 1 for r in row]


def across_edges(page: Page, grid: int, shift: float, slack: float) -> tuple[Page, list[int]]:
    """The page with every glyph whose centre lies within `slack` (a fraction of a square) of the edge
    between two token rows moved just across it (token_cell, `shift` as there), and the indices of the
    boxes moved. Where a line's middle meets an edge, the tokens on both sides see it about as well, so its
    glyphs may be read by either (bench/tower_accuracy.py --edge-slack)."""
    side = max(page.image.size)
    boxes, moved = list(page.char_boxes), []
    for i, (ch, x0, y0, x1, y1) in enumerate(boxes):
        v = view_centre(page, boxes[i])[1] * grid + shift  # in token rows
        row, into = math.floor(v), v - math.floor(v)
        if into < slack and 1 <= row < grid:
            dv = -into - 1e-3  # just into the row above
        elif into > 1 - slack and 0 <= row < grid - 1:
            dv = 1 - into + 1e-3  # just into the row below
        else:
            continue
        dy = dv * side / grid
        boxes[i] = (ch, x0, y0 + dy, x1, y1 + dy)
        moved.append(i)
    return replace(page, char_boxes=boxes), moved


def char_targets(page: Page, grid: int, charset: str = CHARSET, shift: float = 0.0) -> np.ndarray:
    """Multi-hot [grid*grid, len(charset)] float32: cell (row-major) is 1 for each character whose
    box centre lies in it (token_cell). A dense auxiliary target telling each vision token what it sees."""
    index = {ch: k for k, ch in enumerate(charset)}
    targets = np.zeros((grid * grid, len(charset)), dtype=np.float32)
    for box in page.char_boxes:
        if box[0] in index:
            targets[token_cell(page, box, grid, shift), index[box[0]]] = 1.0
    return targets


if __name__ == "__main__":  # python -m ocr_latent.training.pages [N] [small|ordinary]: N sample test-split pages to /tmp
    import sys

    count = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    kind = {"small": SMALL, "ordinary": ORDINARY}[sys.argv[2] if len(sys.argv) > 2 else "small"]
    stream = PageStream(split_documents(load_corpus())["test"], kind, seed=0)
    for i in range(count):
        page = stream[i]
        page.image.save(f"/tmp/pages_sample_{i}.png")
        print(f"/tmp/pages_sample_{i}.png  {page.source}  {page.font} {page.font_size}px  {page.augmentations}")
        print(page.text, end="\n\n")


_CLEAN = {"augment": False}
REPORTED_KINDS = {  # name -> (what it is, its page spec): the kinds of page the project reads and reports on
    "small": ("512x512, 3-6 lines of 20-30 characters at 22-30 px (nano v1's training pages)", PageSpec(**_CLEAN)),
    "small-9-lines": ("512x512, 9 lines at 22-30 px", PageSpec(min_lines=9, max_lines=9, min_line_spacing=1.1,
                                                                max_line_spacing=1.2, min_font_size=22, **_CLEAN)),
    "small-16px": ("512x512, 3-6 lines at 16 px", PageSpec(min_font_size=16, max_font_size=16, **_CLEAN)),
    "large-print": ("1024x1024 or letter/A4, 4-12 lines of up to 30 characters at 40-56 px (nano v4's level 0)",
                    replace(toward_ordinary(0).specs[0], **_CLEAN)),
    "ordinary": ("1024x1024, 15 lines of ~40 characters at 28 px", PageSpec(
        size=1024, min_lines=15, max_lines=15, min_chars_per_line=38, max_chars_per_line=42, min_font_size=28,
        max_font_size=28, min_margin=40, max_margin=100, min_line_spacing=1.3, max_line_spacing=1.5, **_CLEAN)),
    "letter": ("816x1056 letter page, 12-20 lines of 50-65 characters at 20-24 px", PageSpec(
        size=1056, shapes=((816, 1056),), min_lines=12, max_lines=20, min_chars_per_line=50, max_chars_per_line=65,
        min_font_size=20, max_font_size=24, min_margin=60, max_margin=96, **_CLEAN)),
    "dense": ("1024x1024, 25 lines of ~60 characters at 18-20 px", PageSpec(
        size=1024, min_lines=25, max_lines=25, min_chars_per_line=58, max_chars_per_line=62, min_font_size=18,
        max_font_size=20, min_margin=24, max_margin=48, min_line_spacing=1.2, max_line_spacing=1.3, **_CLEAN)),
    "screenshot": ("1280x800, 30 lines of ~80 characters at 13 px", PageSpec(
        size=1280, shapes=((1280, 800),), min_lines=30, max_lines=30, min_chars_per_line=78, max_chars_per_line=82,
        min_font_size=13, max_font_size=13, min_margin=16, max_margin=32, min_line_spacing=1.25,
        max_line_spacing=1.35, fonts=("DejaVuSans.ttf",), **_CLEAN)),
    "latin1": ("1024x1024 ordinary page, a third of its words with Latin-1 letters (é, ü, ß, ñ ...)", PageSpec(
        **{**vars(ORDINARY), "latin1_page_prob": 1.0, "latin1_word_prob": 0.33, "augment": False,
           "max_rotation": 0.0, "shade_prob": 0.0})),
    "photo": ("ordinary pages as photographed: tint, rotation, shading, blur, noise, JPEG (nano v2's test pages)", ORDINARY),
}
