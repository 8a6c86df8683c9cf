"""How far to trust a reading, and a page's codes: `confidence` (0..1) of a decode, from what the decoder
said of its own tokens and how ordinary the page's codes are; `fidelity` (0..1) of an encode, from how much
of the page's features the codes lost. Both are logistic models fitted on held-out pages
(`train.py confidence`) and shipped beside the quantizer they belong to, as JSON (`Calibration`).

The signals, each computed once a sequence ends (the log-probabilities were gathered on the device as the
steps ran: generation.Generator.token_logprobs):
  mean_logprob   the mean log-probability of the chosen tokens: a model reading text it sees is sure of it
  worst_window   the lowest mean over a window of WINDOW tokens: garbage after a good start
  unsure_share   the share of tokens chosen at probability below one half
  ended          1 when the reading ended by itself (EOS), 0 at max_tokens, a loop, or an early stop
  typicality     the mean log-frequency of the page's 4096 codes against the calibration pages' (per code
                 dimension): damaged or foreign codes are rare ones
  log_tokens     log(1 + tokens): a blank page read as nothing is a faithful reading, not an unsure one
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

FEATURES = ("mean_logprob", "worst_window", "unsure_share", "ended", "typicality", "log_tokens")
WINDOW = 16
VERSION = 1


def reading_features(logprobs: list[float], finish_reason: str, typicality: float) -> np.ndarray:
    """The signals of one reading (FEATURES, in that order)."""
    lp = np.asarray(logprobs, dtype=np.float64) if len(logprobs) else np.zeros(1)
    if len(lp) > WINDOW:
        windows = np.convolve(lp, np.ones(WINDOW) / WINDOW, mode="valid")
        worst = float(windows.min())
    else:
        worst = float(lp.mean())
    return np.array([lp.mean(), worst, float((lp < math.log(0.5)).mean()), float(finish_reason == "stop"),
                     typicality, math.log1p(len(logprobs))])


def sigmoid(x: np.ndarray | float):
    return 1.0 / (1.0 + np.exp(-np.clip(x, -40, 40)))


def fit_logistic(x: np.ndarray, y: np.ndarray, l2: float = 1e-2, steps: int = 50) -> tuple[np.ndarray, float]:
    """Weights and bias of P(y=1 | x) = sigmoid(x.w + b), by Newton's method with an L2 penalty on w; the
    features standardised inside (the returned weights apply to raw features)."""
    mean, scale = x.mean(0), x.std(0) + 1e-9
    z = np.hstack([(x - mean) / scale, np.ones((len(x), 1))])
    w = np.zeros(z.shape[1])
    penalty = np.full(z.shape[1], l2 * len(x))
    penalty[-1] = 0.0
    for _ in range(steps):
        p = sigmoid(z @ w)
        grad = z.T @ (p - y) + penalty * w
        hess = (z * (p * (1 - p))[:, None]).T @ z + np.diag(penalty) + 1e-9 * np.eye(len(w))
        w -= np.linalg.solve(hess, grad)
    weights = w[:-1] / scale
    return weights, float(w[-1] - (weights * mean).sum())


@dataclass
class Calibration:
    """The fitted models: confidence = sigmoid(features . weights + bias); fidelity = sigmoid(a * log10(lost)
    + b), `lost` the share of the features' energy the codes lost; `code_logfreq` [dims, levels], the log-
    frequency of each level in each code dimension on the calibration pages. `quantizer`: the fingerprint of
    the quantizer it was fitted for (a calibration of another one is not used). `fitted`: how, on what."""
    quantizer: str
    weights: list[float]
    bias: float
    fidelity_a: float
    fidelity_b: float
    code_logfreq: list[list[float]]
    fitted: dict = field(default_factory=dict)

    def confidence(self, logprobs: list[float], finish_reason: str, codes: np.ndarray) -> float:
        x = reading_features(logprobs, finish_reason, self.typicality(codes))
        return float(sigmoid(x @ np.asarray(self.weights) + self.bias))

    def typicality(self, codes: np.ndarray) -> float:
        table = np.asarray(self.code_logfreq)
        dims = table.shape[0]
        flat = np.asarray(codes, dtype=np.int64).reshape(-1, dims)
        return float(table[np.arange(dims), flat].mean())

    def fidelity(self, lost: float) -> float:
        return float(sigmoid(self.fidelity_a * math.log10(max(lost, 1e-9)) + self.fidelity_b))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps({"version": VERSION, "features": FEATURES, **vars(self)}, indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "Calibration":
        raw = json.loads(Path(path).read_text())
        if raw.get("version") != VERSION or tuple(raw.get("features", ())) != FEATURES:
            raise ValueError(f"{path} is a calibration of another version or other signals: fit it again with "
                             f"`python train.py confidence`")
        return cls(**{k: raw[k] for k in ("quantizer", "weights", "bias", "fidelity_a", "fidelity_b",
                                          "code_logfreq", "fitted")})


def calibration_path(quantizer_path: str | Path) -> Path:
    """Where a quantizer's calibration lives: beside it, `<name>.confidence.json`."""
    q = Path(quantizer_path)
    return q.with_name(q.stem + ".confidence.json")


def code_logfreq(codes: np.ndarray, dims: int, levels: int) -> np.ndarray:
    """[dims, levels] log-frequencies of each level per code dimension over pages' codes [N, 4096] (add-one)."""
    flat = np.asarray(codes, dtype=np.int64).reshape(-1, dims)
    counts = np.stack([np.bincount(flat[:, d], minlength=levels) for d in range(dims)]).astype(np.float64) + 1
    return np.log(counts / counts.sum(1, keepdims=True))
