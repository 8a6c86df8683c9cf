"""Greedy generation on the decoder (decoder.py): continuous batching over a fixed-size batched KV cache.

Sequences are prefilled into free cache slots and dropped between steps; each step advances every
active sequence by one token. A step's shapes are fixed by (rows, attended length), so on CUDA each
shape is captured once as a CUDA graph and replayed (docs/gpu.md); `COMPILE=1` runs steps through
torch.compile. Stopping: EOS, `max_tokens`, or the `RepetitionRule` (windowed no-repeat-n-gram, as
the official scripts, plus a loop detector). On CUDA the n-gram ban runs on the device, over every row at
once, inside the step, and the host reads back the chosen tokens and runs the loop detector while the
device runs the next step (`overlap`): the host's per-row work is off the critical path. Per sequence,
as vLLM's: `min_tokens` (EOS is masked on the device, and the loop detector does not stop it, until that
many tokens are generated) and `ignore_eos` (neither ever: it runs to `max_tokens`, for benchmarks of
fixed output lengths).
"""
from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ocr_latent.decoder import Decoder, deterministic, grouped_mm_traceable, grouped_mm_works

log = logging.getLogger("ocr_latent.decoder")  # the lines it logged before it left decoder.py


@dataclass
class RepetitionRule:
    """vLLM-style windowed no-repeat-n-gram over generated tokens, plus a loop detector."""
    ngram: int = 30
    window: int = 90
    exempt: frozenset[int] = frozenset()
    max_period: int = 128  # exact cycles: a block of <= max_period tokens repeated
    min_cycle_span: int = 48  # ... covering at least this many tokens, and at least 3 copies
    fuzzy_window: int = 240  # near-cycles the n-gram ban bends but does not break:
    fuzzy_gram: int = 8  # under 35% of the 8-grams among the last 240 tokens are distinct
    fuzzy_min_distinct: float = 0.35

    def banned(self, generated: list[int]) -> set[int]:
        n, t = self.ngram, generated
        if n <= 0 or len(t) < n:
            return set()
        prefix, out = t[len(t) - n + 1:], set()
        # an earlier copy of the last n-1 tokens ends where the last token recurs: list.index finds
        # those few places in C, and only they are compared as slices
        for j in occurrences(t, t[-1], max(0, len(t) - self.window) + n - 2, len(t) - 1):
            if t[j - n + 2:j + 1] == prefix:
                out.add(t[j + 1])
        return out - self.exempt

    def looping(self, generated: list[int], grams: Counter | None = None) -> bool:
        """`grams`: the fuzzy window's n-grams kept by `track` (an O(1) count instead of rebuilding the set)."""
        t, L = generated, len(generated)
        # period p needs t[-1 - p] == t[-1]
        for j in reversed(occurrences(t, t[-1], L - 1 - min(self.max_period, L // 3), L - 1) if t else []):
            p = L - 1 - j
            span = max(3 * p, self.min_cycle_span)
            if span <= L and t[-span:-p] == t[L - span + p:]:
                return True
        if L >= self.fuzzy_window:
            g, count = self.fuzzy_gram, self.fuzzy_window - self.fuzzy_gram + 1
            if grams is None:
                tail = t[-self.fuzzy_window:]
                grams = {tuple(tail[i:i + g]) for i in range(count)}
            return len(grams) < self.fuzzy_min_distinct * count
        return False

    def track(self, grams: Counter, generated: list[int]) -> None:
        """Update `grams` (the fuzzy_gram-grams starting in the last fuzzy_window tokens) for one appended token."""
        t, g, w = generated, self.fuzzy_gram, self.fuzzy_window
        if len(t) >= g:
            grams[tuple(t[-g:])] += 1
        if len(t) > w:  # the gram that started just before the window leaves it
            old = tuple(t[-w - 1:-w - 1 + g])
            grams[old] -= 1
            if not grams[old]:
                del grams[old]


def occurrences(t: list[int], value: int, start: int, stop: int) -> list[int]:
    """Indices j in [start, stop) with t[j] == value, ascending."""
    out, j = [], max(start, 0)
    while j < stop:
        try:
            j = t.index(value, j, stop)
        except ValueError:
            break
        out.append(j)
        j += 1
    return out


@dataclass
class Sequence:
    id: int
    slot: int
    max_tokens: int
    tokens: list[int]
    finish_reason: str | None = None
    grams: Counter = field(default_factory=Counter)  # RepetitionRule.track's running count
    min_tokens: int = 0  # EOS and the loop detector cannot end it before it has this many tokens
    ignore_eos: bool = False  # nor ever: it ends at max_tokens
    pending: int = 0  # 1 while a launched step's token for it is not read back yet (Generator's overlap)
    prompt_len: int = 0  # positions of its prompt: its tokens' log-probabilities start at prompt_len - 1

    def wants_step(self) -> bool:
        """Whether a step must still give it a token: not finished, and below max_tokens counting the token of
        a step in flight (`pending`, which the host has not read yet)."""
        return self.finish_reason is None and len(self.tokens) + self.pending < self.max_tokens

    def holds_eos(self) -> bool:
        """Whether EOS is masked for its next token (it has fewer than min_tokens, or ignores EOS)."""
        return self.ignore_eos or len(self.tokens) < self.min_tokens


def chosen_logprobs(logits: Tensor, chosen: Tensor) -> Tensor:
    """log softmax(logits)[chosen] per row, in float32 (the distribution the tokens were chosen from: bans and
    masks included)."""
    logits = logits.float()
    return logits.gather(1, chosen[:, None])[:, 0] - torch.logsumexp(logits, -1)


class Generator:
    """Continuous greedy batching: sequences are added (prefilled into free cache slots) and dropped
    between steps; each `step` advances every active sequence by one token.

    `prefill`: the same decoder at another precision for the prompts (a bf16 copy on a CPU with native
    bf16 matmuls: prompts are hundreds of positions of compute-bound GEMMs, where bf16 is faster, 2.2x
    for a batch of 16 and ~1.2x for one, while one-token steps are bound by memory and overhead,
    where fp32 is faster). It writes the same cache; by default the decoder prefills itself.

    Memory: `kv_tokens` positions of keys/values in all, allocated here once (default: every slot can
    hold `max_positions`): `slot_tokens` = kv_tokens // slots per sequence, prompt included. Call
    `can_admit(prompt_len, max_tokens)` before `add`: `add` cuts a sequence that would not fit down to
    what its slot holds (finish_reason "length").

    Shapes: a step runs rows 0..B-1 and attends over L positions. With `buckets` (default on CUDA)
    B is the next power of two above the rows in use and L the next power of two (>= 256) above the
    longest sequence, so few shapes occur, and with `cuda_graphs` (default on CUDA) each is captured
    once and replayed. Without (the CPU's default) B and L are exact: a CPU gains nothing from fixed
    shapes and would pay for the padding. In deterministic mode (`set_deterministic`) every step is
    (all slots, slot_tokens). `compile`: decode steps through torch.compile (each new shape compiles first).

    The repetition rule's n-gram ban: with `device_rule` (default on CUDA) it runs inside the step, as
    tensor ops over all rows (`_ban`), on each slot's last `window` generated tokens kept on the device
    (`recent`). The step's next input then never waits for the host, and with `overlap` (default with
    `device_rule` on CUDA) `step` launches a step before it reads back the previous one's tokens: the
    host's work on them (the loop detector, the bookkeeping, and whatever the caller does with the text
    before the next `step`) runs while the device computes. A sequence that finished in the step read back
    gets one more token computed, which is ignored (as for finished rows not dropped yet). Without
    `device_rule` the host checks each row's token against its banned set and reads a row's logits only
    when its best is banned: on a CPU a few us a row, where the tensor ops cost tens of us a step at few
    rows; on a GPU ~1 ms a step of 128 rows that the device waits for (bench/gpu.py's step timeline).
    Both choose the same tokens (tests/test_decoder.py)."""

    def __init__(self, decoder: Decoder, slots: int, eos_id: int, rule: RepetitionRule | None,
                 prefill: Decoder | None = None, kv_tokens: int | None = None, buckets: bool | None = None,
                 cuda_graphs: bool | None = None, compile: bool = False, device_rule: bool | None = None,
                 overlap: bool | None = None):
        self.decoder, self.eos_id, self.rule = decoder, eos_id, rule
        self.prefill_decoder = prefill or decoder
        self.slots, self.max_positions = slots, decoder.cfg.max_position_embeddings
        kv_tokens = slots * self.max_positions if kv_tokens is None else kv_tokens
        self.slot_tokens = min(self.max_positions, kv_tokens // slots)
        if self.slot_tokens < 2:
            raise ValueError(f"kv_tokens={kv_tokens} leaves {self.slot_tokens} positions to each of {slots} slots")
        self.cache = decoder.new_cache(slots, self.slot_tokens)
        dev = self.cache.k.device
        # the step's inputs live on the device: each slot's last token and the position it goes to
        self.tokens = torch.zeros(slots, dtype=torch.long, device=dev)
        self.pos = torch.zeros(slots, dtype=torch.long, device=dev)
        # min_tokens and ignore_eos: each slot's position from which its next token may be EOS (0: any), so
        # that a step masks EOS per row without the host (pos never exceeds slot_tokens - 1)
        self.eos_from = torch.zeros(slots, dtype=torch.long, device=dev)
        # the log-probability of each chosen token, kept on the device at the position that chose it (read once a
        # sequence ends, or when a caller asks: `token_logprobs`), so a step costs no extra read to the host
        self.logprobs = torch.zeros(slots, self.slot_tokens, dtype=torch.float32, device=dev)
        self.masks_eos = 0 <= eos_id < decoder.cfg.vocab_size  # tests run without an EOS (-1)
        cuda = dev.type == "cuda"
        self.device_rule = cuda if device_rule is None else device_rule
        # the n-gram ban on the device: each slot's last `window` generated tokens, -1 before the first
        bans = rule is not None and self.device_rule and 0 < rule.ngram <= rule.window
        self.recent = torch.full((slots, rule.window), -1, dtype=torch.long, device=dev) if bans else None
        self.exempt = None
        if bans and rule.exempt:
            self.exempt = torch.zeros(decoder.cfg.vocab_size, dtype=torch.bool, device=dev)
            self.exempt[[t for t in rule.exempt if 0 <= t < decoder.cfg.vocab_size]] = True
        # probed and built now, not inside a capture or a compiled trace: a RoPE table built by a compiled
        # step's first call fails the guards of its second, which then recompiles, inside the graph capture
        for d in {decoder, self.prefill_decoder}:
            grouped_mm_works(dev, d.embed_tokens.weight.dtype)
            d.rope_tables(dev)
        self.buckets = cuda if buckets is None else buckets
        self.cuda_graphs = cuda if cuda_graphs is None else cuda_graphs
        if self.cuda_graphs and not cuda:
            raise ValueError("CUDA graphs need the decoder on a CUDA device")
        self._graphs: dict[tuple[int, int], tuple] = {}  # (B, L) -> (graph, logits, best)
        self._graphs_holding_eos: dict[tuple[int, int], tuple] = {}  # the same, with EOS masked where held
        # torch.compile fuses a step's elementwise chains (norms, RoPE, routing, the combine) into a few
        # kernels; compiled on a shape's first step (outside any capture), the graph captures the result
        self._decode_step = torch.compile(decoder.decode_step) if compile else decoder.decode_step
        # Without a traceable grouped GEMM a compiled step reads each row's experts in place, and beyond those
        # rows runs every expert on every row where the experts are small (MoE.dense_max_weights); with
        # large ones the steps of more rows stay eager
        moe = [layer.mlp for layer in decoder.layers if not layer.dense]
        self.in_place_rows = min((m.in_place_rows for m in moe), default=self.slots)
        traceable = grouped_mm_traceable(decoder.embed_tokens.weight.dtype)
        self.compiled_rows = self.slots if traceable or all(m.compiles_dense() for m in moe) else self.in_place_rows
        self._pool = torch.cuda.graph_pool_handle() if self.cuda_graphs else None
        self.overlap = (cuda if overlap is None else overlap) and self.device_rule
        self._pending: tuple | None = None  # the step launched and not read back: (rows, tokens, event)
        # on CUDA a launched step's tokens are copied into pinned host memory, two buffers in turn, each with
        # an event, so that reading one back waits for that step alone, not for the one launched after it
        self._host_tokens = torch.empty(2, slots, dtype=torch.long, pin_memory=True) if self.overlap and cuda else None
        self._copied = [torch.cuda.Event(), torch.cuda.Event()] if self._host_tokens is not None else None
        self._turn = 0
        self.free = list(range(slots))
        self.active: dict[int, Sequence] = {}  # slot -> sequence
        self.positions: dict[int, int] = {}  # slot -> position of its next token (the host's copy of self.pos)
        self._next_id = 0

    @property
    def capacity(self) -> int:
        return len(self.free)

    @property
    def kv_tokens(self) -> int:
        return self.slots * self.slot_tokens

    def can_admit(self, prompt_len: int, max_tokens: int) -> bool:
        """Whether a sequence of prompt_len positions that may generate max_tokens can be added now: a free
        slot, and room in it for all of its tokens. Never true when prompt_len + max_tokens > slot_tokens."""
        return bool(self.free) and prompt_len + max_tokens <= self.slot_tokens

    @torch.inference_mode()
    def add(self, inputs: list[Tensor], max_tokens: list[int], min_tokens: list[int] | None = None,
            ignore_eos: list[bool] | None = None) -> list[Sequence]:
        """Prefill new sequences; their first token is chosen at once (they may finish right away).
        `min_tokens`, `ignore_eos`: per sequence, as Sequence's (default 0 and False)."""
        min_tokens = min_tokens or [0] * len(inputs)
        ignore_eos = ignore_eos or [False] * len(inputs)
        too_long = [x.shape[0] for x in inputs if x.shape[0] >= self.slot_tokens]
        if too_long:
            raise ValueError(f"prompts of {too_long} positions do not fit a slot of {self.slot_tokens}")
        if len(inputs) > len(self.free):
            raise ValueError(f"{len(inputs)} sequences for {len(self.free)} free slots")
        # lowest free slots first: with drop's compaction the sequences hold slots 0..n-1
        self.free.sort()
        slots, self.free = self.free[:len(inputs)], self.free[len(inputs):]
        if deterministic():  # a prompt's shapes then depend on it alone
            logits = torch.cat([self.prefill_decoder.prefill(self.cache, [s], [x]) for s, x in zip(slots, inputs)])
        else:
            logits = self.prefill_decoder.prefill(self.cache, slots, inputs)
        held = [i for i, (least, ignore) in enumerate(zip(min_tokens, ignore_eos)) if ignore or least > 0]
        if held and self.masks_eos:
            logits[held, self.eos_id] = float("-inf")
        chosen = logits.argmax(-1)
        index = torch.tensor(slots, device=self.tokens.device)
        last = torch.tensor([x.shape[0] - 1 for x in inputs], device=self.tokens.device)
        self.logprobs[index, last] = chosen_logprobs(logits, chosen)
        best = chosen.tolist()
        seqs = []
        for slot, x, limit, least, ignore, row, token in zip(slots, inputs, max_tokens, min_tokens, ignore_eos,
                                                              logits, best):
            # the last token is chosen, never written: a slot holds prompt + max_tokens - 1 positions
            seq = Sequence(self._next_id, slot, min(limit, self.slot_tokens - x.shape[0]), [],
                           min_tokens=least, ignore_eos=ignore, prompt_len=x.shape[0])
            self._next_id += 1
            self.active[slot], self.positions[slot] = seq, x.shape[0]
            self._choose(seq, token, row)
            seqs.append(seq)
        self.tokens[index] = torch.tensor([s.tokens[-1] for s in seqs], device=self.tokens.device)
        if self.recent is not None:
            self.recent[index] = -1
            self.recent[index, -1] = self.tokens[index]
        self.pos[index] = torch.tensor([x.shape[0] for x in inputs], device=self.pos.device)
        # a step fed the token at position p chooses token number p - prompt + 2: EOS waits for p >= prompt + min - 1
        self.eos_from[index] = torch.tensor([self.slot_tokens if s.ignore_eos else x.shape[0] + s.min_tokens - 1
                                             for s, x in zip(seqs, inputs)], device=self.pos.device)
        return seqs

    @torch.inference_mode()
    def drop(self, seq: Sequence) -> None:
        if self.active.get(seq.slot) is not seq:
            return
        hole = seq.slot
        del self.active[hole], self.positions[hole]
        last = max(self.active, default=-1)
        if last > hole:
            # Keep the sequences in slots 0..n-1: the one in the highest slot moves into the hole
            # (a copy of its cached prefix, once). Otherwise a step would either run the idle rows
            # between them or gather the running rows' keys/values in every layer, every step.
            moved = self.active.pop(last)
            self.positions[hole] = self.positions.pop(last)
            self.cache.move(last, hole, self.positions[hole])
            self.tokens[hole], self.pos[hole] = self.tokens[last], self.pos[last]  # device to device
            self.eos_from[hole] = self.eos_from[last]
            self.logprobs[hole] = self.logprobs[last]
            if self.recent is not None:
                self.recent[hole] = self.recent[last]
            moved.slot, self.active[hole], hole = hole, moved, last
        self.free.append(hole)

    @torch.inference_mode()
    def token_logprobs(self, seq: Sequence) -> list[float]:
        """The log-probability of each of `seq`'s tokens as it was chosen (one read from the device)."""
        start = seq.prompt_len - 1
        return self.logprobs[seq.slot, start:start + len(seq.tokens)].tolist()

    def shape(self, rows: int, length: int) -> tuple[int, int]:
        """(B, L) of a step over slots 0..rows-1 whose longest sequence attends over `length` positions."""
        if deterministic():
            return self.slots, self.slot_tokens
        if not self.buckets:
            return rows, length
        return min(self.slots, 1 << (rows - 1).bit_length()), min(self.slot_tokens, max(256, 1 << (length - 1).bit_length()))

    @torch.inference_mode()
    def step(self) -> None:
        """One step for every running sequence. With `overlap`, the step is launched, then the previous
        one's tokens are read back and chosen, so a sequence's tokens lag the device by one step."""
        launched = self._launch()
        if self.overlap:
            launched, self._pending = self._pending, launched
        if launched is not None:
            self._collect(*launched)

    def _launch(self) -> tuple | None:
        """Run (or, on CUDA, enqueue) a step of every running sequence: the sequences it gives a token, with
        their rows, that token's tensor, and on CUDA with overlap the event of its copy to the host."""
        running = [s for s in self.active.values() if s.wants_step()]
        if not running:
            return None
        # rows 0..max slot: finished sequences not dropped yet run along (their tokens are ignored)
        B, L = self.shape(max(self.active) + 1, max(self.positions[s.slot] for s in running) + 1)
        self.cache.ensure(L)
        # the host knows whether any row holds EOS back; only then does the step mask it (row by row, on the device)
        logits, best = self._run(B, L, self.masks_eos and any(s.holds_eos() for s in running))
        rows = [(s, s.slot) for s in running]
        for seq in running:
            self.positions[seq.slot] += 1  # the position its next step feeds: the device's pos, mirrored
            seq.pending = 1
        if not self.overlap:
            return rows, best, None if self.device_rule else logits, None
        if self._host_tokens is None:  # a CPU runs the step at once: its tokens only need to outlive the next one
            return rows, best.clone(), None, None
        # the graph's output is overwritten by the next replay: copy it out first, in stream order
        self._turn ^= 1
        tokens, copied = self._host_tokens[self._turn, :B], self._copied[self._turn]
        tokens.copy_(best, non_blocking=True)
        copied.record(torch.cuda.current_stream(best.device))
        return rows, tokens, None, copied

    def _collect(self, rows: list, tokens: Tensor, logits: Tensor | None, copied) -> None:
        """A launched step's tokens, read back (the step's one copy to the host) and chosen for each sequence
        still running in the generator (one dropped since, or finished by its previous token, is skipped)."""
        if copied is not None:
            copied.synchronize()
        best = tokens.tolist()
        for seq, row in rows:
            seq.pending = 0
            if seq.finish_reason is None and self.active.get(seq.slot) is seq:
                self._choose(seq, best[row], logits[row] if logits is not None else None)

    def _run(self, B: int, L: int, hold_eos: bool = False) -> tuple[Tensor, Tensor]:
        if not self.cuda_graphs:
            return self._advance(B, L, hold_eos)
        graphs = self._graphs_holding_eos if hold_eos else self._graphs
        if (B, L) not in graphs:
            try:
                self._capture(B, L, hold_eos)
            except RuntimeError as e:
                # a step that a graph cannot hold (an op that waits on the host, say) still runs: eagerly,
                # from now on (nothing ran in the failed capture; its warm-up rewrote what the step writes)
                log.warning("CUDA graph capture of a (%d, %d) step failed, decoding without graphs: %s", B, L, e)
                self.cuda_graphs = False
                return self._advance(B, L, hold_eos)
        graph, logits, best = graphs[B, L]
        graph.replay()
        return logits, best

    def _compute(self, B: int, L: int, hold_eos: bool = False) -> tuple[Tensor, Tensor]:
        try:
            step = self._decode_step if B <= self.compiled_rows else self.decoder.decode_step
            logits = step(self.cache, self.tokens[:B], self.pos[:B], L)
        except Exception as e:  # noqa: BLE001 - compiling failed (no C++ compiler, say): decode without
            if self._decode_step == self.decoder.decode_step:
                raise
            log.warning("torch.compile of the decode step failed, decoding without it: %s: %s", type(e).__name__, e)
            self._decode_step = self.decoder.decode_step
            logits = self._decode_step(self.cache, self.tokens[:B], self.pos[:B], L)
        if hold_eos:  # outside the compiled step: its graphs stay as they are
            logits[:, self.eos_id].masked_fill_(self.pos[:B] < self.eos_from[:B], float("-inf"))
        if self.recent is not None and self.rule is not None:
            self._ban(logits, self.recent[:B])
        best_logit, best = logits.max(-1)
        # the chosen token's log-probability, kept where this step's position is (no read to the host)
        self.logprobs[:B].scatter_(1, self.pos[:B, None], (best_logit.float() - torch.logsumexp(logits.float(), -1))[:, None])
        return logits, best

    def _ban(self, logits: Tensor, recent: Tensor) -> None:
        """RepetitionRule.banned for every row at once, as tensor ops (no host read): where the last n-1
        generated tokens occurred earlier in the window, the token that followed that copy gets -inf.
        `recent`: each row's last `window` generated tokens, right-aligned, -1 before its first."""
        n = self.rule.ngram
        grams = recent.unfold(1, n - 1, 1)  # [B, window - n + 2, n - 1]: each run of n - 1 tokens
        # an earlier copy of the last n - 1 tokens (a copy holding a -1 never equals them once n are
        # generated); a sum, not all(), whose reduction over bools is 8x slower on a CPU
        copies = ((grams[:, :-1] == grams[:, -1:]).sum(-1) == n - 1) & (recent[:, -n] >= 0)[:, None]
        follow = recent[:, n - 1:].clamp(min=0)  # the token after each copy
        if self.exempt is not None:
            copies &= ~self.exempt[follow]
        # adding 0 or -inf: the same sum in any order, so a token banned by several copies needs no care
        logits.scatter_add_(1, follow, torch.zeros_like(follow, dtype=logits.dtype).masked_fill_(copies, float("-inf")))

    def warmup_shapes(self) -> list[tuple[int, int]]:
        """The (rows, length) shapes whose compiling covers every step a compiled generator will run: a static
        one-row step, one general in rows and length, and the same beyond the rows that read experts in place
        (another MoE path) where steps of more rows are compiled too."""
        shapes = [(1, 256), (1, 257), (2, 257)]
        if self.compiled_rows > self.in_place_rows:
            rows = self.in_place_rows + 1
            shapes += [(rows, 257), (min(self.compiled_rows, 2 * rows), 258)]  # distinct rows once bucketed too
        return shapes

    @torch.inference_mode()
    def prepare(self, shapes: list[tuple[int, int]]) -> None:
        """Run one step of each (rows, length) shape before any sequence is added, so that compiling and
        capturing happen now rather than in a request (a compiled step generalises to the other shapes
        once it has met two of each dimension). Writes only into free slots, which prefill overwrites."""
        if self.active:
            raise ValueError("prepare() runs before any sequence is added")
        for B, L in shapes:
            B, L = self.shape(min(B, self.slots), min(L, self.slot_tokens))
            self.cache.ensure(L)
            self._run(B, L)
        self.tokens.zero_()
        self.pos.zero_()
        self.eos_from.zero_()
        if self.recent is not None:
            self.recent.fill_(-1)

    def _advance(self, B: int, L: int, hold_eos: bool = False) -> tuple[Tensor, Tensor]:
        """A step of rows 0..B-1, and their next inputs set on the device: the best allowed tokens (without
        `device_rule` the host overrides a row whose best is banned) at the next positions."""
        logits, best = self._compute(B, L, hold_eos)
        self.tokens[:B] = best
        if self.recent is not None:
            self.recent[:B] = torch.cat([self.recent[:B, 1:], best[:, None]], 1)
        # rows that run past their end (finished, padding) keep writing inside their own slot
        self.pos[:B] = (self.pos[:B] + 1).clamp_(max=self.slot_tokens - 1)
        return logits, best

    def _capture(self, B: int, L: int, hold_eos: bool = False) -> None:
        """Capture one step of shape (B, L) as a CUDA graph (the inputs, cache and outputs keep their
        addresses, so replaying it is the step). All graphs share one memory pool: they never run at once."""
        # warm-up outside the capture (library handles, the MoE probe, the RoPE table): _compute
        # rewrites the same keys/values the step will write and advances nothing
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._compute(B, L, hold_eos)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA work (an encode batch, a test) does not break the capture
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            logits, best = self._advance(B, L, hold_eos)
        (self._graphs_holding_eos if hold_eos else self._graphs)[B, L] = (graph, logits, best)

    def _choose(self, seq: Sequence, token: int, logits: Tensor | None = None) -> None:
        """Append `token` (the row's best allowed token: the device applied the ban) and decide whether the
        sequence stops. Without `device_rule` the token is the row's argmax, and the ban is checked here."""
        banned = self.rule.banned(seq.tokens) if not self.device_rule and self.rule is not None else None
        if banned and token in banned:
            # only a banned argmax changes the choice; this row's logits come to the host for it (the
            # few steps that need it), and the device's next input follows
            row = logits.clone()
            row[list(banned)] = float("-inf")
            token = int(row.argmax())
            self.tokens[seq.slot] = token
            self.logprobs[seq.slot, self.positions[seq.slot] - 1] = chosen_logprobs(row[None], row.argmax()[None])[0]
        held = seq.holds_eos()  # EOS was masked for this token (so it is not EOS where an EOS exists)
        seq.tokens.append(token)
        loops = self.rule is not None and not seq.ignore_eos  # the loop detector may end it
        if loops:
            self.rule.track(seq.grams, seq.tokens)
        if token == self.eos_id and not held:
            seq.finish_reason = "stop"
        elif loops and len(seq.tokens) >= seq.min_tokens and self.rule.looping(seq.tokens, seq.grams):
            seq.finish_reason = "repetition"
        elif len(seq.tokens) >= seq.max_tokens:
            seq.finish_reason = "length"

    def generate(self, inputs: list[Tensor], max_tokens: list[int], min_tokens: list[int] | None = None,
                 ignore_eos: list[bool] | None = None) -> list[Sequence]:
        """Convenience: run a fixed set of sequences to completion (each leaves the batch as it finishes)."""
        seqs = self.add(inputs, max_tokens, min_tokens, ignore_eos)
        while True:
            for s in seqs:
                if s.finish_reason is not None:
                    self.drop(s)
            if all(s.finish_reason is not None for s in seqs):
                return seqs
            self.step()
