"""Reading metrics: character and word error rates (Levenshtein distance over the reference length)."""
from __future__ import annotations


def edit_distance(a, b) -> int:
    prev = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        cur = [i]
        for j, y in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (x != y)))
        prev = cur
    return prev[-1]


def cer(hyp: str, ref: str) -> float:
    return edit_distance(hyp, ref) / max(1, len(ref))


def wer(hyp: str, ref: str) -> float:
    return edit_distance(hyp.split(), ref.split()) / max(1, len(ref.split()))
