"""Reading metrics: character and word error rates (Levenshtein distance over the reference length).

The distance is rapidfuzz's C implementation (unit costs for insertion, deletion and substitution),
over characters for CER and over whitespace-separated words for WER: an ordinary page of 1,000
characters is a million cells of the dynamic programme, too slow in pure Python for evaluating
hundreds of pages."""
from __future__ import annotations

from rapidfuzz.distance import Levenshtein


def edit_distance(a, b) -> int:
    return Levenshtein.distance(a, b)


def cer(hyp: str, ref: str) -> float:
    return edit_distance(hyp, ref) / max(1, len(ref))


def wer(hyp: str, ref: str) -> float:
    return edit_distance(hyp.split(), ref.split()) / max(1, len(ref.split()))
