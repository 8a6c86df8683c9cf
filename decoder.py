"""DeepSeek-OCR's language model (DeepSeek-V2-style MoE, "DeepSeek3B-MoE") with a fixed-size batched KV cache.

Facts from deepseek-ocr-facts.md §4-6: plain MHA with full-head rotate-half RoPE (theta 1e4),
layer 0 a dense SwiGLU, then MoE layers (fp32 softmax router, greedy top-k without
renormalisation, shared experts added), RMSNorm eps 1e-6, untied lm_head. Expert weights are
stacked ([E, I, H]) so one grouped GEMM runs all experts without a Python loop or host sync;
checkpoint.py converts between these and the original per-expert keys.

Decoding is shaped for accelerators and runs the same code on a CPU (docs/gpu.md): the KV cache is
allocated once from a token budget; a decode step's shapes are fixed by (rows, attended length), its
inputs stay on the device and it copies one thing back (the new tokens), so on CUDA each shape is
captured once as a CUDA graph and replayed. Generation on this decoder (continuous batching, cache
slots, CUDA graphs, the repetition rule) is generation.py's `Generator`.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

log = logging.getLogger("ocr_latent.decoder")
_DETERMINISTIC = False


def set_deterministic(on: bool = True) -> None:
    """Decoding whose tokens depend on nothing but the sequence (not on what else is in the batch, nor on
    the run): every decode step runs all slots over the whole slot length, prompts are prefilled one at
    a time, and the MoE of a step computes each row on its own (no grouped GEMM, whose per-expert row
    counts depend on the other rows), with torch's deterministic kernels. Slower; for tests and audits."""
    global _DETERMINISTIC
    _DETERMINISTIC = on
    if on:  # cuBLAS is deterministic only with a fixed workspace (read when its handle is created)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(on)


def deterministic() -> bool:
    return _DETERMINISTIC


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
    max_position_embeddings: int = 8192  # RoPE table length, and the longest sequence a generator holds

    # Keys this decoder does not read, with the values it implements (None: absent, the code default). A
    # checkpoint with group-limited routing, renormalised top-k, scaled RoPE, MLA, biases or another
    # activation would load and read wrong text; it is refused, naming the key.
    IMPLEMENTS = {"topk_method": ("greedy", None), "norm_topk_prob": (False, None), "scoring_func": ("softmax", None),
                  "rope_scaling": (None,), "hidden_act": ("silu", None), "attention_bias": (False, None),
                  "use_mla": (False, None), "kv_lora_rank": (None,), "q_lora_rank": (None,), "moe_layer_freq": (1, None)}

    @classmethod
    def from_config(cls, cfg: dict) -> "DecoderConfig":
        # the original builds DeepseekV2Config from the *top-level* keys; absent ones take code defaults
        for key, values in cls.IMPLEMENTS.items():
            if cfg.get(key) not in values:
                shown = " or ".join("absent" if v is None else json.dumps(v) for v in values)
                raise ValueError(f"config.json: {key} is {json.dumps(cfg.get(key))}; this decoder implements only "
                                 f"{shown} (DeepSeek-OCR's values) and would read wrong text with it")
        # with greedy routing the reference ignores n_group/topk_group (they matter to group_limited_greedy only)
        return cls(**{k: cfg[k] for k in cls.__dataclass_fields__ if cfg.get(k) is not None})

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x: Tensor) -> Tensor:
        if x.device.type != "cpu":  # one kernel where torch has a fused one, instead of seven (one-token steps launch hundreds)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        h = x.float()
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def rope_table(length: int, d: int, theta: float, device) -> tuple[Tensor, Tensor]:
    """fp32 cos, sin [length, d] of Llama rotate-half RoPE over the whole head, for positions 0..length-1."""
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d)
    freqs = torch.arange(length, device=device, dtype=torch.float32)[:, None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class KVCache:
    """Keys/values of `slots` sequences of up to `length` positions each, allocated once, never resized.

    A sequence owns one slot from prefill until it is dropped; its entries are never touched by the
    others, so sequences join and leave a running batch freely. A decode step's row i is slot i, so it
    reads the cache in place (the generator keeps its sequences in slots 0..n-1).

    On a CPU the tensors start uninitialised, so the OS maps their pages only as positions are first
    reached: a budget of many slots x positions costs memory as far as sequences actually go, as the
    old growing cache did. Positions are zeroed (`ensure`) before anything reads them: a masked
    position gets probability 0, but 0 x a garbage NaN is NaN. A GPU commits the memory anyway, so
    there it is zeroed at once (and nothing runs between the steps of a captured graph)."""

    def __init__(self, layers: int, slots: int, heads: int, head_dim: int, length: int, dtype, device):
        device = torch.device(device)
        lazy = device.type == "cpu"
        make = torch.empty if lazy else torch.zeros
        # one spare position that nothing reads or writes: a step's view of the first L positions is then never
        # the whole tensor, whose contiguity torch.compile would otherwise guard on (a recompile at L = length)
        self.k = make(layers, slots, heads, length + 1, head_dim, dtype=dtype, device=device)
        self.v = make(layers, slots, heads, length + 1, head_dim, dtype=dtype, device=device)
        self.length = length
        self.ready = 0 if lazy else length  # positions [0, ready) hold zeros or written entries in every slot

    def ensure(self, length: int) -> None:
        """Positions [0, length) of every slot readable (zeroed where never written), before a step reaches them."""
        if length > self.ready:
            end = min(self.length, max(length, 2 * self.ready, 64))
            self.k[:, :, :, self.ready:end].zero_()
            self.v[:, :, :, self.ready:end].zero_()
            self.ready = end

    def write(self, layer: int, rows: Tensor, positions: Tensor, k: Tensor, v: Tensor) -> None:
        """k, v [n,h,T,d] into slots rows[n] at positions[n,T]."""
        n, h, T, d = k.shape
        rows = rows[:, None].expand(n, T)
        k, v = k.transpose(1, 2).to(self.k.dtype), v.transpose(1, 2).to(self.v.dtype)  # a bf16 prefill into an fp32 cache
        if torch.compiler.is_compiling():
            # indexed on the whole tensor: compiled, a write into a layer's view of it became a copy of the
            # whole cache in every step (eager, that index is the slower one)
            index = (torch.full_like(rows, layer), rows, slice(None), positions)
            self.k[index], self.v[index] = k, v
        else:
            self.k[layer][rows, :, positions], self.v[layer][rows, :, positions] = k, v

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy slot src's first `length` entries (all layers) into slot dst."""
        self.k[:, dst, :, :length] = self.k[:, src, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]


def product_sum(x: Tensor, w: Tensor) -> Tensor:
    """x @ w.T as a product and a sum over the last dim, in fp32 (w may lead with x's batch dims): a compiled
    step turns it into a reduction that reads w where it lies and fuses with its neighbours. Eagerly it
    would materialise the products: for compiled steps of few rows only."""
    return (x.float()[..., None, :] * w.float()).sum(-1)


class Linear(nn.Linear):
    """nn.Linear without bias (the same parameter and key). In a compiled decode step of few rows it is a
    reduction rather than a GEMM call, which the compiler can fuse with what comes before and after (the
    norm, RoPE, the cache write, the silu product) and with sibling projections of the same input, where
    each GEMM call would be a kernel of its own for a row or two. `in_place = False`: GEMM calls
    (bench/gpu.py measures both; docs/gpu.md)."""
    in_place = True
    in_place_rows = 8  # beyond a few rows, tensor-core GEMMs read each weight once for all of them

    def __init__(self, fan_in: int, fan_out: int):
        super().__init__(fan_in, fan_out, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        if self.in_place and torch.compiler.is_compiling() and x.shape[:-1].numel() <= self.in_place_rows:
            return product_sum(x, self.weight).to(x.dtype)
        return F.linear(x, self.weight.to(x.dtype))  # the router's fp32 input meets a bf16 weight


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        H, self.heads = cfg.hidden_size, cfg.num_attention_heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = Linear(H, H), Linear(H, H), Linear(H, H), Linear(H, H)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache: KVCache | None = None, layer: int = 0,
                rows: Tensor | None = None, positions: Tensor | None = None, mask: Tensor | None = None) -> Tensor:
        B, T, H = x.shape
        q, k, v = (p(x).view(B, T, self.heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)  # the table is fp32; under autocast q is not
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        if cache is not None:
            cache.write(layer, rows, positions, k, v)
        if mask is None:  # prefill / full forward: causal over this call's tokens
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # one new token per row against its slot's cached prefix (row i is slot i: a view, no gather)
            L = mask.shape[-1]
            out = attend_cached(q, cache.k[layer, :B, :, :L], cache.v[layer, :B, :, :L], mask)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, H))


def attend_cached(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """A decode step's attention: one query per row [B,h,1,d] over its cached keys/values [B,h,L,d], where
    mask [B,1,1,L] says which positions the row has reached."""
    if q.device.type == "cpu" and q.dtype == torch.float32:
        # plain matmuls: for a single query token torch's CPU flash kernel is ~5x slower
        scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
        return scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = Linear(dim, hidden), Linear(dim, hidden), Linear(hidden, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


_GROUPED: dict[tuple[str, torch.dtype], bool] = {}


def grouped_mm_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch._grouped_mm runs on this device at this dtype without waiting on the host: probed once
    per pair. CPUs have it; on CUDA only bf16 on Hopper or newer is one kernel (elsewhere torch loops over
    the groups with their offsets copied to the host, which a CUDA graph cannot capture)."""
    key = (str(device), dtype)
    if key not in _GROUPED:
        device = torch.device(device)
        if device.type == "cuda" and (dtype != torch.bfloat16 or torch.cuda.get_device_capability(device) < (9, 0)):
            _GROUPED[key] = False
            return False
        try:
            x, w = torch.ones(16, 16, device=device, dtype=dtype), torch.ones(2, 16, 16, device=device, dtype=dtype)
            out = torch._grouped_mm(x, w.transpose(1, 2), offs=torch.tensor([8, 16], dtype=torch.int32, device=device))
            _GROUPED[key] = bool((out == 16).all())
        except (RuntimeError, NotImplementedError, AttributeError):
            _GROUPED[key] = False
    return _GROUPED[key]


def grouped_mm(x: Tensor, w: Tensor, offsets: Tensor) -> Tensor:
    """Rows of x sorted by group; offsets = cumulative row ends; w [G, out, in] -> [rows, out]."""
    if grouped_mm_works(x.device, x.dtype):  # one grouped GEMM, no host sync
        return torch._grouped_mm(x, w.transpose(1, 2), offs=offsets)
    return per_group_mm(x, w, offsets)


def grouped_mm_traceable(dtype: torch.dtype) -> bool:
    """torch.compile traces _grouped_mm through a shape check that accepts bf16 only (a CPU runs fp32)."""
    return dtype == torch.bfloat16


def per_group_mm(x: Tensor, w: Tensor, offsets: Tensor) -> Tensor:
    """The same as grouped_mm, one GEMM per non-empty group (one host sync per call)."""
    ends = offsets.tolist()
    out = x.new_empty(x.shape[0], w.shape[1])
    for g, (a, b) in enumerate(zip([0] + ends[:-1], ends)):
        if b > a:
            out[a:b] = x[a:b] @ w[g].T
    return out


class MoE(nn.Module):
    # A compiled step of few rows routes and reads its experts in place (`_route_in_place`,
    # `_gathered_in_place`): on a GPU that replaces topk, sort and the grouped GEMMs (their grouping and
    # mostly empty groups) with fused kernels. False: as uncompiled (bench/gpu.py measures both).
    in_place = True
    # Beyond those rows, a compiled step with no traceable grouped GEMM (fp32) runs every expert on every
    # row (`_dense`) while a layer's experts hold at most this many weights: small experts cost a GEMM call
    # each in the eager grouped path, more than the E/k times more multiplies of one fused computation;
    # large ones (the real model's are 220M a layer) would pay those multiplies in full.
    dense_max_weights = 1 << 22

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        E, H, I = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.top_k, self.scale = cfg.num_experts_per_tok, cfg.routed_scaling_factor
        self.gate = Linear(H, E)
        self.w_gate, self.w_up = nn.Parameter(torch.empty(E, I, H)), nn.Parameter(torch.empty(E, I, H))
        self.w_down = nn.Parameter(torch.empty(E, H, I))
        self.shared_experts = MLP(H, I * cfg.n_shared_experts)

    @property
    def in_place_rows(self) -> int:
        """The most rows a compiled step reads experts for in place (rows x top-k within the experts)."""
        return self.w_gate.shape[0] // self.top_k

    def compiles_dense(self) -> bool:
        return 3 * self.w_gate.numel() <= self.dense_max_weights

    def route(self, x: Tensor, in_place: bool = False) -> tuple[Tensor, Tensor]:
        """Each row's top-k experts in ascending order, and their weights: the combine adds the experts'
        outputs in this order, one fixed order whatever else is in the batch (a scatter-add's order is the
        kernel's choice). `in_place`: as comparisons and sums (`_route_in_place`)."""
        probs = self.gate(x.float()).softmax(dim=-1)  # router in fp32
        if in_place:
            weight, expert = self._route_in_place(probs)
        else:
            weight, expert = probs.topk(self.top_k, dim=-1, sorted=False)  # greedy, not renormalised
            expert, perm = expert.sort(dim=-1)
            weight = weight.gather(-1, perm)
        return weight * self.scale, expert

    def _route_in_place(self, probs: Tensor) -> tuple[Tensor, Tensor]:
        """topk and sort as comparisons and sums, which a compiled step fuses into a kernel or two (topk and
        sort are library calls it cannot fuse). An expert is chosen when fewer than k others beat it (a
        higher probability, or an equal one at a lower index: topk leaves exact ties unspecified); its place
        among the chosen is the count of chosen experts below it."""
        E, k, dev = probs.shape[-1], self.top_k, probs.device
        e = torch.arange(E, device=dev)
        below = e[None, :] < e[:, None]  # [E, E]: below[i, j] = j < i
        mine, other = probs[:, :, None], probs[:, None, :]
        chosen = ((other > mine) | (other == mine) & below).sum(-1) < k  # [N, E]
        place = (chosen[:, None, :] & below).sum(-1)  # [N, E]: chosen experts below each
        slot = chosen[:, None, :] & (place[:, None, :] == torch.arange(k, device=dev)[:, None])  # [N, k, E]
        return (slot * probs[:, None, :]).sum(-1), (slot * e).sum(-1)

    def forward(self, x: Tensor, step: bool = False) -> Tensor:
        """`step`: a decode step, which must not wait on the device (CUDA graphs) and, in deterministic
        mode, must compute each row independently of the others."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        few = x.shape[0] <= self.in_place_rows
        in_place = step and self.in_place and few and torch.compiler.is_compiling()
        weight, expert = self.route(x, in_place)
        if in_place:
            out = self._gathered_in_place(x, expert)
        elif step and (deterministic() or not grouped_mm_works(x.device, x.dtype)
                     or torch.compiler.is_compiling() and not grouped_mm_traceable(x.dtype)):
            out = self._gathered(x, expert) if few else self._dense(x, expert)
        else:  # prompts without a grouped GEMM fall back to one GEMM per expert (a host sync per layer)
            out = self._grouped(x, expert)
        routed = out * weight[..., None]  # fp32 (weight is): the cast and the product in one kernel
        y = routed[:, 0]
        for j in range(1, self.top_k):
            y = y + routed[:, j]
        return (y.to(x.dtype) + self.shared_experts(x)).view(shape)

    def _grouped(self, x: Tensor, expert: Tensor) -> Tensor:
        """Rows sorted by expert through one grouped GEMM per projection -> [N, k, H] in expert order per row."""
        N, k = expert.shape
        sorted_experts, order = expert.flatten().sort(stable=True)
        # each expert's rows end where its run in the sorted list ends (a search: no scatter, no host sync)
        experts = torch.arange(self.w_gate.shape[0], device=x.device)
        offsets = torch.searchsorted(sorted_experts, experts, right=True, out_int32=True)
        xs = x[order // k]
        h = F.silu(grouped_mm(xs, self.w_gate, offsets)) * grouped_mm(xs, self.w_up, offsets)
        out = torch.empty_like(xs)
        out[order] = grouped_mm(h, self.w_down, offsets)  # back to (token, expert) order: a scatter, not a second sort
        return out.view(N, k, -1)

    def _gathered(self, x: Tensor, expert: Tensor) -> Tensor:
        """Each row through its own k experts, their matrices gathered per row (as gpt-fast's Mixtral
        does): no host sync, no row sees another; it reads k experts per row, so only for few rows."""
        wg, wu, wd = self.w_gate[expert], self.w_up[expert], self.w_down[expert]  # [N,k,I,H], [N,k,H,I]
        h = F.silu(torch.einsum("nd,nkid->nki", x, wg)) * torch.einsum("nd,nkid->nki", x, wu)
        return torch.einsum("nki,nkdi->nkd", h, wd)

    def _gathered_in_place(self, x: Tensor, expert: Tensor) -> Tensor:
        """`_gathered` written as reductions, for a compiled step: the compiler turns each row's expert index
        into the loads of one fused reduction per projection, which reads the k experts where they lie (no
        copy of their matrices, no sort, no grouping), and the silu product into its epilogue. Accumulates
        in fp32; the silu product is rounded to the weights' dtype, as a GEMM's output would be. Eagerly it
        would materialise [N, k, I, H] products: only under torch.compile."""
        rows = x[:, None, :]  # [N, 1, H] against each row's k experts
        h = (F.silu(product_sum(rows, self.w_gate[expert])) * product_sum(rows, self.w_up[expert])).to(x.dtype)
        return product_sum(h, self.w_down[expert]).to(x.dtype)  # [N, k, I] -> [N, k, H]

    def _dense(self, x: Tensor, expert: Tensor) -> Tensor:
        """Every row through every expert, then each row's k picked: no host sync, no row sees another;
        it reads each expert once, where gathering would read more."""
        h = F.silu(torch.einsum("nd,eid->nei", x, self.w_gate)) * torch.einsum("nd,eid->nei", x, self.w_up)
        out = torch.einsum("nei,edi->ned", h, self.w_down)
        return out.gather(1, expert[..., None].expand(-1, -1, out.shape[-1]))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, index: int):
        super().__init__()
        self.index, self.dense = index, index < cfg.first_k_dense_replace
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size) if self.dense else MoE(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, cache=None, rows=None, positions=None, mask=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, self.index, rows, positions, mask)
        h = self.post_attention_layernorm(x)
        return x + (self.mlp(h) if self.dense else self.mlp(h, step=mask is not None))


class Decoder(nn.Module):
    """Token embeddings, layers, final norm, lm_head, and the two learned layout vectors."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)
        self.image_newline = nn.Parameter(torch.zeros(cfg.hidden_size))
        self.view_seperator = nn.Parameter(torch.zeros(cfg.hidden_size))  # sic: the checkpoint's spelling
        # device -> RoPE cos/sin tables up to max positions, built on first use there (not a buffer: modules
        # are built on the meta device and loaded by assignment, and a dtype cast must not round them)
        self._rope: dict[torch.device, tuple[Tensor, Tensor]] = {}

    def rope_tables(self, device: torch.device) -> tuple[Tensor, Tensor]:
        """fp32 cos, sin [max_positions, head_dim] on `device`, built there on first use."""
        if device not in self._rope:
            c = self.cfg
            self._rope[device] = rope_table(c.max_position_embeddings, c.head_dim, c.rope_theta, device)
        return self._rope[device]

    def rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """fp32 cos, sin [B,1,T,d] for positions [B,T]: rows of the table, once per forward (not per layer)."""
        cos, sin = self.rope_tables(positions.device)
        return cos[positions][:, None], sin[positions][:, None]

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

    def hidden(self, embeds: Tensor, positions: Tensor, cache=None, rows=None, mask=None) -> Tensor:
        cos, sin = (t.to(embeds.dtype) for t in self.rope(positions))  # once, not in every layer
        x = embeds
        for layer in self.layers:
            x = layer(x, cos, sin, cache, rows, positions, mask)
        return self.norm(x)

    def forward(self, embeds: Tensor) -> Tensor:
        """Full causal forward (no cache): embeds [B,T,D] -> fp32 logits [B,T,V]."""
        B, T, _ = embeds.shape
        positions = torch.arange(T, device=embeds.device).expand(B, T)
        return self.lm_head(self.hidden(embeds, positions)).float()

    def new_cache(self, slots: int, length: int | None = None) -> KVCache:
        p = self.embed_tokens.weight
        return KVCache(self.cfg.num_hidden_layers, slots, self.cfg.num_attention_heads, self.cfg.head_dim,
                       length or self.cfg.max_position_embeddings, p.dtype, p.device)

    def prefill(self, cache: KVCache, slots: list[int], inputs: list[Tensor]) -> Tensor:
        """Run new sequences (embeds [L_i, D] each) into their slots; return next-token logits [n, V]."""
        lengths = [x.shape[0] for x in inputs]
        T, dev = max(lengths), cache.k.device
        cache.ensure(T)
        # right padding is safe: causal attention keeps valid positions from seeing it, and each
        # sequence's first decode step overwrites the padded cache entries it would later read
        dtype = self.embed_tokens.weight.dtype
        embeds = torch.stack([F.pad(x.to(dtype), (0, 0, 0, T - x.shape[0])) for x in inputs])
        positions = torch.arange(T, device=dev).expand(len(inputs), T)
        h = self.hidden(embeds, positions, cache, torch.tensor(slots, device=dev))
        last = torch.tensor(lengths, device=dev) - 1
        return self.lm_head(h[torch.arange(len(inputs), device=dev), last]).float()

    def decode_step(self, cache: KVCache, tokens: Tensor, positions: Tensor, length: int) -> Tensor:
        """One token for each of rows 0..B-1 (row i is slot i) at its own position, attending to its slot's
        first `length` positions: tokens, positions [B] on the device -> fp32 logits [B, V]. Its shapes
        are fixed by (B, length) and it reads nothing back to the host: capturable as a CUDA graph."""
        B, dev = tokens.shape[0], tokens.device
        mask = (torch.arange(length, device=dev)[None, :] <= positions[:, None])[:, None, None, :]
        h = self.hidden(self.embed_tokens(tokens)[:, None], positions[:, None], cache, torch.arange(B, device=dev), mask)
        return self.lm_head(h[:, 0]).float()
