"""DeepSeek-OCR's language model (DeepSeek-V2-style MoE, "DeepSeek3B-MoE") with a batched KV cache.

Facts from deepseek-ocr-facts.md §4-6: plain MHA with full-head rotate-half RoPE (theta 1e4),
layer 0 a dense SwiGLU, then MoE layers (fp32 softmax router, greedy top-k without
renormalisation, shared experts added), RMSNorm eps 1e-6, untied lm_head. Expert weights are
stacked ([E, I, H]) so one grouped GEMM runs all experts without a Python loop or host sync;
checkpoint.py converts between these and the original per-expert keys.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass
class DecoderConfig:
    vocab_size: int = 129280
    hidden_size: int = 1280
    intermediate_size: int = 6848
    moe_intermediate_size: int = 896
    num_hidden_layers: int = 12
    num_attention_heads: int = 10
    n_routed_experts: int = 64
    n_shared_experts: int = 2
    num_experts_per_tok: int = 6
    first_k_dense_replace: int = 1
    routed_scaling_factor: float = 1.0
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6

    @classmethod
    def from_config(cls, cfg: dict) -> "DecoderConfig":
        # the original builds DeepseekV2Config from the *top-level* keys; absent ones take code defaults
        return cls(**{k: cfg[k] for k in cls.__dataclass_fields__ if cfg.get(k) is not None})

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x: Tensor) -> Tensor:
        h = x.float()
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def rope_tables(positions: Tensor, d: int, theta: float, dtype) -> tuple[Tensor, Tensor]:
    """cos, sin [B,1,T,d] of Llama rotate-half RoPE over the whole head, positions [B,T]."""
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, device=positions.device, dtype=torch.float32) / d)
    freqs = positions.float()[..., None] * inv_freq  # [B,T,d/2]
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]  # [B,1,T,d]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class KVCache(nn.Module):
    """Keys/values for `slots` independent sequences, each at its own length.

    A sequence owns one slot from prefill until it is dropped; its entries are never touched by
    the others, so sequences join and leave a running batch freely. Capacity grows on demand."""

    def __init__(self, layers: int, slots: int, heads: int, head_dim: int, dtype, device, capacity: int = 256):
        super().__init__()
        self.k = torch.zeros(layers, slots, heads, capacity, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)

    def reserve(self, length: int) -> None:
        if length > self.k.shape[3]:
            grow = max(length, 2 * self.k.shape[3]) - self.k.shape[3]
            pad = lambda t: F.pad(t, (0, 0, 0, grow))
            self.k, self.v = pad(self.k), pad(self.v)

    def update(self, layer: int, slots: Tensor, positions: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write k, v [n,h,T,d] at (slots[n], positions[n,T]); return this layer's whole cache."""
        n, h, T, d = k.shape
        if isinstance(slots, slice):
            slots = torch.arange(slots.start, slots.stop, device=k.device)
        rows = slots[:, None].expand(n, T)
        self.k[layer][rows, :, positions] = k.transpose(1, 2).to(self.k.dtype)  # a bf16 prefill into an fp32 cache
        self.v[layer][rows, :, positions] = v.transpose(1, 2).to(self.v.dtype)
        return self.k[layer], self.v[layer]

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy slot src's first `length` entries (all layers) into slot dst."""
        self.k[:, dst, :, :length] = self.k[:, src, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        H, self.heads, self.theta = cfg.hidden_size, cfg.num_attention_heads, cfg.rope_theta
        self.q_proj, self.k_proj = nn.Linear(H, H, bias=False), nn.Linear(H, H, bias=False)
        self.v_proj, self.o_proj = nn.Linear(H, H, bias=False), nn.Linear(H, H, bias=False)

    def forward(self, x: Tensor, positions: Tensor, cache: KVCache | None, layer: int, slots: Tensor | None,
                decode_mask: Tensor | None) -> Tensor:
        B, T, H = x.shape
        q, k, v = (p(x).view(B, T, self.heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        cos, sin = rope_tables(positions, q.shape[-1], self.theta, q.dtype)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        if cache is not None:
            ck, cv = cache.update(layer, slots, positions, k, v)
        if decode_mask is None:  # prefill / full forward: causal over this call's tokens
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # one new token per slot against that slot's cached prefix (a slice of slots reads a view)
            L = decode_mask.shape[-1]
            if not isinstance(slots, slice):  # index_select copies whole slot rows: ~6x faster than ck[slots]
                ck, cv, slots = ck.index_select(0, slots), cv.index_select(0, slots), slice(None)
            ck, cv = ck[slots, :, :L], cv[slots, :, :L]
            if q.device.type == "cpu" and q.dtype == torch.float32:
                # plain matmuls: for a single query token torch's CPU flash kernel is ~5x slower
                scores = (q @ ck.transpose(-1, -2)) * q.shape[-1] ** -0.5
                out = scores.masked_fill(~decode_mask, float("-inf")).softmax(-1) @ cv
            else:
                out = F.scaled_dot_product_attention(q, ck, cv, attn_mask=decode_mask)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, H))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def grouped_mm(x: Tensor, w: Tensor, offsets: Tensor) -> Tensor:
    """Rows of x sorted by group; offsets = cumulative row ends; w [G, out, in] -> [rows, out]."""
    if x.device.type == "cpu" or x.dtype == torch.bfloat16:  # one grouped GEMM, no host sync
        return torch._grouped_mm(x, w.transpose(1, 2), offs=offsets)
    # fp32/fp16 on an accelerator have no grouped kernel. Serve GPUs in bf16 (the server's default
    # there) to stay on the path above.
    return per_group_mm(x, w, offsets)


def per_group_mm(x: Tensor, w: Tensor, offsets: Tensor) -> Tensor:
    """The same as grouped_mm, one GEMM per non-empty group (one host sync per call)."""
    ends = offsets.tolist()
    out = x.new_empty(x.shape[0], w.shape[1])
    for g, (a, b) in enumerate(zip([0] + ends[:-1], ends)):
        if b > a:
            out[a:b] = x[a:b] @ w[g].T
    return out


class MoE(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        E, H, I = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.top_k, self.scale = cfg.num_experts_per_tok, cfg.routed_scaling_factor
        self.gate = nn.Linear(H, E, bias=False)
        self.w_gate, self.w_up = nn.Parameter(torch.empty(E, I, H)), nn.Parameter(torch.empty(E, I, H))
        self.w_down = nn.Parameter(torch.empty(E, H, I))
        self.shared_experts = MLP(H, I * cfg.n_shared_experts)

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        probs = F.linear(x.float(), self.gate.weight.float()).softmax(dim=-1)  # router in fp32
        weight, expert = probs.topk(self.top_k, dim=-1, sorted=False)  # greedy, not renormalised
        return weight * self.scale, expert

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weight, expert = self.route(x)
        flat = expert.flatten()
        order = flat.argsort(stable=True)
        token = order // self.top_k
        counts = torch.zeros(self.w_gate.shape[0], dtype=torch.int32, device=x.device)
        offsets = counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32)).cumsum(0, dtype=torch.int32)
        xs = x[token]
        h = F.silu(grouped_mm(xs, self.w_gate, offsets)) * grouped_mm(xs, self.w_up, offsets)
        routed = grouped_mm(h, self.w_down, offsets).float() * weight.flatten()[order, None]
        y = torch.zeros(x.shape, dtype=torch.float32, device=x.device).index_add_(0, token, routed)
        return (y.to(x.dtype) + self.shared_experts(x)).view(shape)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, index: int):
        super().__init__()
        self.index = index
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size) if index < cfg.first_k_dense_replace else MoE(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, positions, cache=None, slots=None, decode_mask=None):
        x = x + self.self_attn(self.input_layernorm(x), positions, cache, self.index, slots, decode_mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    """Token embeddings, layers, final norm, lm_head, and the two learned layout vectors."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.image_newline = nn.Parameter(torch.zeros(cfg.hidden_size))
        self.view_seperator = nn.Parameter(torch.zeros(cfg.hidden_size))  # sic: the checkpoint's spelling

    def layout_image(self, features: Tensor) -> Tensor:
        """[g*g, D] projected features -> [g*(g+1)+1, D]: each row + image_newline, then view_seperator."""
        g = int(features.shape[0] ** 0.5)
        grid = features.view(g, g, -1).to(self.image_newline.dtype)
        grid = torch.cat([grid, self.image_newline.expand(g, 1, -1)], dim=1).reshape(-1, grid.shape[-1])
        return torch.cat([grid, self.view_seperator[None]])

    def build_inputs(self, image_embeds: Tensor, prompt_ids: list[int], bos_id: int) -> Tensor:
        """[BOS] + image positions + prompt text, as embeddings [L, D] (the image token ids never reach the
        embedding table: their rows are replaced by the image embeddings, like masked_scatter upstream)."""
        ids = torch.tensor([bos_id, *prompt_ids], device=image_embeds.device)
        text = self.embed_tokens(ids)
        return torch.cat([text[:1], image_embeds.to(text.dtype), text[1:]])

    def hidden(self, embeds: Tensor, positions: Tensor, cache=None, slots=None, decode_mask=None) -> Tensor:
        x = embeds
        for layer in self.layers:
            x = layer(x, positions, cache, slots, decode_mask)
        return self.norm(x)

    def forward(self, embeds: Tensor) -> Tensor:
        """Full causal forward (no cache): embeds [B,T,D] -> fp32 logits [B,T,V]."""
        B, T, _ = embeds.shape
        positions = torch.arange(T, device=embeds.device).expand(B, T)
        return self.lm_head(self.hidden(embeds, positions)).float()

    def new_cache(self, slots: int, capacity: int = 256) -> KVCache:
        p = self.embed_tokens.weight
        return KVCache(self.cfg.num_hidden_layers, slots, self.cfg.num_attention_heads, self.cfg.head_dim,
                       p.dtype, p.device, capacity)

    def prefill(self, cache: KVCache, slots: list[int], inputs: list[Tensor]) -> Tensor:
        """Run new sequences (embeds [L_i, D] each) into their slots; return next-token logits [n, V]."""
        lengths = torch.tensor([x.shape[0] for x in inputs], device=cache.k.device)
        T = int(lengths.max())
        cache.reserve(T)
        # right padding is safe: causal attention keeps valid positions from seeing it, and each
        # sequence's first decode step overwrites the padded cache entries it would later read
        dtype = self.embed_tokens.weight.dtype
        embeds = torch.stack([F.pad(x.to(dtype), (0, 0, 0, T - x.shape[0])) for x in inputs])
        positions = torch.arange(T, device=embeds.device).expand(len(inputs), T)
        h = self.hidden(embeds, positions, cache, torch.tensor(slots, device=embeds.device))
        return self.lm_head(h[torch.arange(len(inputs)), lengths - 1]).float()

    def decode_step(self, cache: KVCache, slots: Tensor | slice, positions: Tensor, tokens: Tensor) -> Tensor:
        """One token per slot at its own position: tokens/positions/slots [n] -> logits [n, V].
        `slots` may be a slice (a contiguous run of slots): attention then reads the cache in place
        instead of gathering a copy of every running sequence's keys and values in every layer."""
        L = int(positions.max()) + 1
        cache.reserve(L)
        mask = (torch.arange(L, device=tokens.device)[None, :] <= positions[:, None])[:, None, None, :]
        h = self.hidden(self.embed_tokens(tokens)[:, None], positions[:, None], cache, slots, mask)
        return self.lm_head(h[:, 0]).float()


# ----------------------------------------------------------------------------- greedy generation
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


class Generator:
    """Continuous greedy batching: sequences are added (prefilled into free cache slots) and dropped
    between steps; each `step` advances every active sequence by one token.

    `prefill`: the same decoder at another precision for the prompts (a bf16 copy on a CPU with native
    bf16 matmuls: prompts are hundreds of positions of compute-bound GEMMs, where bf16 is faster, 2.2x
    for a batch of 16 and ~1.2x for one, while one-token steps are bound by memory and overhead,
    where fp32 is faster). It writes the same cache; by default the decoder prefills itself."""

    def __init__(self, decoder: Decoder, slots: int, eos_id: int, rule: RepetitionRule | None,
                 prefill: Decoder | None = None):
        self.decoder, self.eos_id, self.rule = decoder, eos_id, rule
        self.prefill_decoder = prefill or decoder
        self.cache = decoder.new_cache(slots)
        self.free = list(range(slots))
        self.active: dict[int, Sequence] = {}  # slot -> sequence
        self.positions: dict[int, int] = {}  # slot -> position of its next token
        self._next_id = 0

    @property
    def capacity(self) -> int:
        return len(self.free)

    @torch.inference_mode()
    def add(self, inputs: list[Tensor], max_tokens: list[int]) -> list[Sequence]:
        """Prefill new sequences; their first token is chosen at once (they may finish right away)."""
        # lowest free slots first: with drop's compaction the sequences hold slots 0..n-1
        self.free.sort()
        slots, self.free = self.free[:len(inputs)], self.free[len(inputs):]
        logits = self.prefill_decoder.prefill(self.cache, slots, inputs)
        seqs = []
        for slot, x, limit, row in zip(slots, inputs, max_tokens, logits):
            seq = Sequence(self._next_id, slot, limit, [])
            self._next_id += 1
            self.active[slot], self.positions[slot] = seq, x.shape[0]
            self._choose(seq, row)
            seqs.append(seq)
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
            moved.slot, self.active[hole], hole = hole, moved, last
        self.free.append(hole)

    @torch.inference_mode()
    def step(self) -> None:
        running = sorted((s for s in self.active.values() if s.finish_reason is None), key=lambda s: s.slot)
        if not running:
            return
        dev = self.cache.k.device
        lo, hi = running[0].slot, running[-1].slot + 1
        if hi - lo <= 2 * len(running):
            # Run the whole slot range lo..hi, idle slots included (finished sequences not dropped yet),
            # so that attention reads the cache in place (a gather of the running slots' keys/values
            # costs more than a few wasted rows).
            # An idle row writes its dummy key/value at position 0, which a finished sequence never
            # reads again and a new one's prefill overwrites.
            rows: list[Sequence | None] = [None] * (hi - lo)
            for s in running:
                rows[s.slot - lo] = s
            slots = slice(lo, hi)
        else:
            rows, slots = list(running), torch.tensor([s.slot for s in running], device=dev)
        positions = torch.tensor([self.positions[s.slot] if s else 0 for s in rows], device=dev)
        tokens = torch.tensor([s.tokens[-1] if s else 0 for s in rows], device=dev)
        logits = self.decoder.decode_step(self.cache, slots, positions, tokens)
        best = logits.argmax(-1).tolist()  # one call for the batch; rows with banned tokens redo theirs
        for seq, row, token in zip(rows, logits, best):
            if seq is None:
                continue
            self.positions[seq.slot] += 1
            self._choose(seq, row, token)

    def _choose(self, seq: Sequence, logits: Tensor, token: int | None = None) -> None:
        banned = self.rule.banned(seq.tokens) if self.rule is not None else None
        if banned:
            logits = logits.clone()
            logits[list(banned)] = float("-inf")
            token = None
        token = int(logits.argmax()) if token is None else token
        seq.tokens.append(token)
        if self.rule is not None:
            self.rule.track(seq.grams, seq.tokens)
        if token == self.eos_id:
            seq.finish_reason = "stop"
        elif self.rule is not None and self.rule.looping(seq.tokens, seq.grams):
            seq.finish_reason = "repetition"
        elif len(seq.tokens) >= seq.max_tokens:
            seq.finish_reason = "length"

    def generate(self, inputs: list[Tensor], max_tokens: list[int]) -> list[Sequence]:
        """Convenience: run a fixed set of sequences to completion."""
        seqs = self.add(inputs, max_tokens)
        while any(s.finish_reason is None for s in seqs):
            self.step()
        for s in seqs:
            self.drop(s)
        return seqs
