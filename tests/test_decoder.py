"""Decoding shaped for accelerators, checked on the CPU: a KV cache fixed at construction, admission by
tokens, batch invariance in deterministic mode, decode steps that never read back to the host, the MoE
paths agreeing, the repetition ban steering the device's next input, a failed graph capture falling back,
held-out pages read token for token as recorded, and bench/gpu.py --tiny."""
import json
import subprocess
import sys

import pytest
import torch

from ocr_latent import decoder as decoder_module
from ocr_latent.checkpoint import build_modules
from conftest import ROOT, small_config
from ocr_latent.decoder import DecoderConfig, rope_table, set_deterministic
from ocr_latent.generation import Generator, RepetitionRule


def _prompts(decoder, lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, decoder.cfg.hidden_size, generator=gen) for n in lengths]


@pytest.fixture
def deterministic_mode():
    set_deterministic(True)
    yield
    set_deterministic(False)


@pytest.mark.slow  # decodes 1,100 steps (~35 s here)
def test_the_kv_cache_is_allocated_once_and_never_resized(small_modules):
    _, decoder = small_modules
    gen = Generator(decoder, 2, eos_id=-1, rule=None, kv_tokens=2 * 600)
    assert (gen.slot_tokens, gen.kv_tokens, gen.max_positions) == (600, 1200, 8192)
    k, v = gen.cache.k, gen.cache.v
    storage = lambda: (k.data_ptr(), v.data_ptr(), k.untyped_storage().nbytes(), v.untyped_storage().nbytes())
    before = storage()
    (a,) = gen.add(_prompts(decoder, [40]), [500])  # 540 positions: the old cache grew at 256 and 512
    while a.finish_reason is None:
        gen.step()
        assert gen.cache.k is k and gen.cache.v is v
    assert a.finish_reason == "length" and len(a.tokens) == 500
    # a sequence asking for more than its slot holds is cut to what fits (call can_admit to refuse instead)
    (b,) = gen.add(_prompts(decoder, [100], seed=1), [10_000])
    while b.finish_reason is None:
        gen.step()
    assert b.finish_reason == "length" and len(b.tokens) == 600 - 100
    assert storage() == before and gen.cache.ready == 600


def test_admission_is_by_tokens_and_positions(small_modules):
    _, decoder = small_modules
    gen = Generator(decoder, 2, eos_id=-1, rule=None, kv_tokens=1000)
    assert gen.slot_tokens == 500 and gen.can_admit(100, 400) and not gen.can_admit(100, 401)
    a, b = gen.add(_prompts(decoder, [10, 20]), [5, 5])
    assert gen.capacity == 0 and not gen.can_admit(10, 10)
    gen.drop(a)
    assert gen.can_admit(10, 10)
    with pytest.raises(ValueError, match="do not fit"):
        gen.add(_prompts(decoder, [500]), [1])
    # by default every slot holds the model's positions; the real config names them
    assert Generator(decoder, 3, eos_id=-1, rule=None).slot_tokens == decoder.cfg.max_position_embeddings == 8192
    real = json.loads((ROOT / "bench" / "deepseek-ocr-config.json").read_text())
    assert DecoderConfig.from_config(real).max_position_embeddings == 8192
    assert Generator(decoder, 2, eos_id=-1, rule=None, kv_tokens=2 * 10**6).slot_tokens == 8192


def test_a_sequence_gets_the_same_logits_whatever_else_is_in_the_batch(small_modules, deterministic_mode, monkeypatch):
    """Deterministic mode: the same sequence alone, and in a batch where others join, leave and move it
    between slots, gets bit-identical logits at every step (outside it they differ in the last bits)."""
    _, decoder = small_modules
    seen, choose = {}, Generator._choose

    def recording(self, seq, token, logits):  # the host's rule (a CPU's default) hands it each row's logits
        seen.setdefault(id(seq), []).append(logits.clone())
        choose(self, seq, token, logits)

    monkeypatch.setattr(Generator, "_choose", recording)
    prompts = _prompts(decoder, [9, 23, 14, 5, 30], seed=7)
    (alone,) = Generator(decoder, 4, eos_id=-1, rule=None, kv_tokens=256).generate([prompts[0]], [20])
    gen = Generator(decoder, 4, eos_id=-1, rule=None, kv_tokens=256)
    short, long = gen.add([prompts[3], prompts[1]], [7, 30])
    for _ in range(3):
        gen.step()
    (seq,) = gen.add([prompts[0]], [20])  # joins mid-decode, in slot 2
    assert seq.slot == 2
    later = []
    while seq.finish_reason is None:
        if short.finish_reason is not None and not later:
            gen.drop(short)  # leaves from slot 0: the highest slot (this sequence) moves into its place
            later = gen.add([prompts[4]], [12])
        gen.step()
    assert seq.slot == 0 and seq.tokens == alone.tokens
    assert all(torch.equal(x, y) for x, y in zip(seen[id(alone)], seen[id(seq)], strict=True))


@pytest.mark.parametrize("dtype, grouped", [(torch.float32, False), (torch.bfloat16, True)])
def test_a_decode_step_never_reads_back_to_the_host(monkeypatch, dtype, grouped):
    """On the meta device, where reading a value back to the host raises. The MoE takes its grouped GEMM
    (bf16), or without one (fp32 here) gathers the chosen experts (few rows) or runs all of them."""
    _, decoder = build_modules(small_config(), "meta")  # 8 experts, top-3
    decoder = decoder.to(dtype)
    monkeypatch.setitem(decoder_module._GROUPED, ("meta", dtype), grouped)
    cache = decoder.new_cache(4, 64)
    tokens, positions = torch.zeros(4, dtype=torch.long, device="meta"), torch.zeros(4, dtype=torch.long, device="meta")
    with torch.inference_mode():
        for rows in (2, 4):  # 2 x 3 chosen experts <= 8: gathered; 4 x 3 > 8: all experts
            assert decoder.decode_step(cache, tokens[:rows], positions[:rows], 32).shape == (rows, 300)
        prompt = [torch.zeros(5, 64, device="meta", dtype=dtype)]
        if grouped:
            assert decoder.prefill(cache, [0], prompt).shape == (1, 300)
        else:  # the check has teeth: prompts without a grouped GEMM take one GEMM per expert, a sync a layer
            with pytest.raises(RuntimeError):
                decoder.prefill(cache, [0], prompt)


def test_the_ban_inside_the_step_never_reads_back_to_the_host():
    """The n-gram ban that a CUDA step runs (and its graph captures), on the meta device, where a value read
    back to the host raises: every row's ban, exempt tokens and the window's shift are tensor ops alone."""
    gen = object.__new__(Generator)
    gen.rule = RepetitionRule(exempt=frozenset({3, 4}))
    gen.exempt = torch.zeros(300, dtype=torch.bool, device="meta")
    recent = torch.zeros(4, gen.rule.window, dtype=torch.long, device="meta")
    logits = torch.zeros(4, 300, device="meta")
    with torch.inference_mode():
        gen._ban(logits, recent)
        best = logits.argmax(-1)
        assert torch.cat([recent[:, 1:], best[:, None]], 1).shape == recent.shape


def test_the_moe_paths_agree(small_modules, monkeypatch):
    _, decoder = small_modules
    moe = decoder.layers[1].mlp
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        weight, expert = moe.route(x)
        assert (expert.diff(dim=-1) > 0).all()  # ascending: the combine's fixed order
        # the compiled step's routing by comparisons: the same experts and the same weights, bit for bit
        in_place = moe.route(x, in_place=True)
        assert torch.equal(in_place[1], expert) and torch.equal(in_place[0], weight)
        # exact ties (all experts equally likely): exactly k chosen, the lowest indices, as a strict order would
        tied_weight, tied = moe._route_in_place(torch.full((2, 8), 1 / 8))
        assert tied.tolist() == [[0, 1, 2]] * 2 and (tied_weight == 1 / 8).all()
        ref = torch.stack([torch.stack([
            (torch.nn.functional.silu(x[n] @ moe.w_gate[e].T) * (x[n] @ moe.w_up[e].T)) @ moe.w_down[e].T
            for e in expert[n].tolist()]) for n in range(6)])
        for path in (moe._grouped, moe._gathered, moe._gathered_in_place, moe._dense):
            assert (path(x, expert) - ref).abs().max() < 1e-5, path.__name__
        batched = moe(x[:, None])
        monkeypatch.setitem(decoder_module._GROUPED, ("cpu", torch.float32), False)  # one GEMM per expert
        assert (moe._grouped(x, expert) - ref).abs().max() < 1e-5
        assert (moe(x[:, None]) - batched).abs().max() < 1e-5
        assert (moe(x[:, None], step=True) - batched).abs().max() < 1e-5


@pytest.mark.slow  # torch.compile (~24 s here)
def test_compiled_steps_that_read_experts_in_place_give_the_eager_tokens(small_modules, monkeypatch):
    """The compiled step of few rows as a GPU runs it (each row's experts read in place, every projection a
    reduction fused with its neighbours), here on the CPU: the same tokens as eager steps, and the in-place
    path really traced."""
    _, decoder = small_modules
    traced = []
    in_place = decoder_module.MoE._gathered_in_place
    monkeypatch.setattr(decoder_module.MoE, "_gathered_in_place", lambda self, x, e: traced.append(x.shape) or in_place(self, x, e))
    monkeypatch.setattr(decoder_module.MoE, "in_place", True)
    monkeypatch.setattr(decoder_module.Linear, "in_place", True)
    torch._dynamo.reset()
    prompts = _prompts(decoder, [17, 30], seed=7)
    eager = Generator(decoder, 2, eos_id=-1, rule=None, kv_tokens=2 * 128).generate(prompts, [40, 25])
    compiled = Generator(decoder, 2, eos_id=-1, rule=None, kv_tokens=2 * 128, compile=True).generate(prompts, [40, 25])
    assert [s.tokens for s in compiled] == [s.tokens for s in eager]
    assert traced, "the compiled step did not take the in-place path"


@pytest.mark.slow  # torch.compile (~20 s here)
def test_compiled_steps_of_more_rows_run_every_expert_give_the_eager_tokens_and_compile_only_in_warm_up(
        small_modules, monkeypatch):
    """Beyond the rows that read experts in place, a compiled fp32 step runs every expert on every row (the
    eager steps use the grouped GEMM): the same tokens, and the warm-up shapes compile everything the
    generation then meets, down to one row and up to every slot."""
    from torch._dynamo.utils import counters
    _, decoder = small_modules
    traced, rows = [], []
    dense = decoder_module.MoE._dense

    def noted_dense(self, x, e):
        if not traced:  # noted once: a list that kept growing would recompile the step at every call
            traced.append(x.shape[0])
        return dense(self, x, e)
    monkeypatch.setattr(decoder_module.MoE, "_dense", noted_dense)
    torch._dynamo.reset()
    prompts = _prompts(decoder, [17, 30, 9, 22, 41], seed=11)
    limits = [40, 25, 33, 12, 28]
    eager = Generator(decoder, 5, eos_id=-1, rule=None, kv_tokens=5 * 128).generate(prompts, limits)
    gen = Generator(decoder, 5, eos_id=-1, rule=None, kv_tokens=5 * 300, compile=True)  # warm-up lengths fit
    assert (gen.in_place_rows, gen.compiled_rows) == (2, 5)  # 8 experts, top 3
    gen.prepare(gen.warmup_shapes())
    assert traced, "the warm-up compiled no step that runs every expert"
    graphs, step = counters["stats"]["unique_graphs"], gen._decode_step
    gen._decode_step = lambda cache, tokens, *a: rows.append(tokens.shape[0]) or step(cache, tokens, *a)
    compiled = gen.generate(prompts, limits)
    assert [s.tokens for s in compiled] == [s.tokens for s in eager]
    assert set(rows) == {1, 2, 3, 4, 5}, "not every step went through the compiled step"
    assert counters["stats"]["unique_graphs"] == graphs, "a step compiled after the warm-up"
    monkeypatch.setattr(decoder_module.MoE, "dense_max_weights", 0)  # experts too large to run densely
    assert Generator(decoder, 5, eos_id=-1, rule=None, kv_tokens=5 * 128, compile=True).compiled_rows == 2


def test_after_warm_up_no_compiled_step_compiles_again_not_the_capture_nor_a_whole_slot(small_modules):
    """On CUDA a shape's second compiled step is the one captured in a graph, where compiling fails (the
    service then decoded eagerly, without graphs). So a first step must build nothing its guards read
    (the RoPE table of a freshly loaded decoder), and a step over a whole slot must not be a new shape
    to the compiler."""
    from torch._dynamo.utils import counters
    _, decoder = small_modules
    decoder._rope.clear()  # as loaded: no prefill has built the table yet
    torch._dynamo.reset()
    gen = Generator(decoder, 2, eos_id=-1, rule=None, kv_tokens=2 * 300, compile=True)
    for shape in gen.warmup_shapes():  # as a GPU runs them: each shape's first step, then its capture
        gen.prepare([shape])
        graphs = counters["stats"]["unique_graphs"]
        gen.prepare([shape])
        assert counters["stats"]["unique_graphs"] == graphs, f"the second step of {shape} compiled again"
    gen.prepare([(1, 300), (2, 300), (2, 299)])
    assert counters["stats"]["unique_graphs"] == graphs, "a step over a whole slot compiled after the warm-up"


def test_bucketed_shapes_pad_rows_and_length_without_changing_the_tokens(small_modules):
    _, decoder = small_modules
    gen = Generator(decoder, 12, eos_id=-1, rule=None, kv_tokens=12 * 600, buckets=True)
    assert [gen.shape(n, L) for n, L in ((1, 5), (3, 300), (9, 513), (12, 600))] == \
        [(1, 256), (4, 512), (12, 600), (12, 600)]
    prompts = _prompts(decoder, [9, 23, 14], seed=5)
    exact = Generator(decoder, 4, eos_id=-1, rule=None, kv_tokens=4 * 300).generate(prompts, [30, 12, 30])
    padded = Generator(decoder, 4, eos_id=-1, rule=None, kv_tokens=4 * 300, buckets=True).generate(prompts, [30, 12, 30])
    assert [s.tokens for s in exact] == [s.tokens for s in padded]
    with pytest.raises(ValueError, match="CUDA"):
        Generator(decoder, 2, eos_id=-1, rule=None, kv_tokens=64, cuda_graphs=True)


def test_rope_rows_equal_the_formula_per_position():
    cos, sin = rope_table(300, 64, 10000.0, "cpu")
    positions = torch.tensor([0, 7, 299])
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64)
    freqs = positions.float()[:, None] * inv_freq
    assert torch.equal(cos[positions], torch.cat([freqs, freqs], -1).cos())
    assert torch.equal(sin[positions], torch.cat([freqs, freqs], -1).sin())


# the n-gram ban checked by the host row by row (a CPU's default), as tensor ops inside the step (CUDA's), and
# those with the host's reading of each step overlapped with the next (CUDA's default), all run here on the CPU
RULE_PLACES = {"host": {}, "device": {"device_rule": True, "overlap": False},
               "device, overlapped": {"device_rule": True, "overlap": True}}


@pytest.mark.parametrize("place", RULE_PLACES)
@pytest.mark.parametrize("exempt", [frozenset(), frozenset(range(0, 300, 2))])
@torch.inference_mode()
def test_a_banned_best_token_is_replaced_and_the_next_step_reads_the_replacement(small_modules, place, exempt):
    """Against a full recompute of every prefix with the same rule: the token chosen for a row whose
    argmax is banned must be the token the device feeds to the next step."""
    _, decoder = small_modules
    rule = RepetitionRule(ngram=3, window=40, max_period=0, fuzzy_window=10**6, exempt=exempt)
    (x,) = _prompts(decoder, [12], seed=11)
    (seq,) = Generator(decoder, 2, eos_id=-1, rule=rule, kv_tokens=256, **RULE_PLACES[place]).generate([x], [60])
    tokens, overridden = [], 0
    for _ in range(60):
        logits = decoder(torch.cat([x, decoder.embed_tokens(torch.tensor(tokens, dtype=torch.long))])[None])[0, -1]
        banned = rule.banned(tokens)
        if banned and int(logits.argmax()) in banned:
            overridden += 1
            logits[list(banned)] = float("-inf")
        tokens.append(int(logits.argmax()))
    assert overridden >= 3 and seq.tokens == tokens


def drive(decoder, prompts, limits, least, ignore, cancel: tuple[int, int], **options) -> list:
    """An engine's pattern on a generator of 4 slots: up to two sequences join a turn, finished ones leave
    (the highest slot moves into the hole, while a step may be in flight), one is cancelled at a turn;
    every sequence's (tokens, finish_reason)."""
    rule = RepetitionRule(ngram=3, window=40, max_period=8, min_cycle_span=12, fuzzy_window=30, fuzzy_gram=3,
                          fuzzy_min_distinct=0.97, exempt=frozenset(range(0, 300, 7)))
    gen = Generator(decoder, 4, eos_id=231, rule=rule, kv_tokens=4 * 128, **options)
    queue, running, out, turn = list(range(len(prompts))), [], {}, 0
    while queue or running:
        turn += 1
        for i, seq in list(running):
            if seq.finish_reason is not None or (i, turn) == cancel:
                gen.drop(seq)
                running.remove((i, seq))
                out[i] = (seq.tokens, seq.finish_reason)
        if k := min(gen.capacity, len(queue), 2):
            ids, queue = queue[:k], queue[k:]
            seqs = gen.add([prompts[i] for i in ids], [limits[i] for i in ids], [least[i] for i in ids],
                           [ignore[i] for i in ids])
            running += list(zip(ids, seqs))
        if any(seq.finish_reason is None for _, seq in running):
            gen.step()
    return [out[i] for i in range(len(prompts))]


def test_the_rule_on_the_device_and_overlapped_steps_choose_the_host_rules_tokens_and_stops(small_modules):
    """Ten sequences through four slots, with a strict rule (bans, loops), an EOS, min_tokens and ignore_eos:
    the same tokens and finish reasons wherever the ban runs and whether or not the host reads each step
    while the next one runs. A sequence cancelled mid-way has read one token fewer when overlapped."""
    _, decoder = small_modules
    prompts = _prompts(decoder, [9, 23, 14, 5, 30, 12, 17, 8, 21, 11], seed=5)
    case = dict(limits=[40, 25, 60, 33, 12, 50, 45, 28, 60, 19], least=[0, 0, 10, 0, 0, 0, 5, 0, 0, 0],
                ignore=[False, False, False, True, False, False, False, False, True, False], cancel=(2, 15))
    host = drive(decoder, prompts, **case, **RULE_PLACES["host"])
    assert {"stop", "length", "repetition", None} <= {reason for _, reason in host}  # every way of ending was met
    for place in ("device", "device, overlapped"):
        got = drive(decoder, prompts, **case, **RULE_PLACES[place])
        assert [r for _, r in got] == [r for _, r in host], place
        assert [t for i, (t, _) in enumerate(got) if i != 2] == [t for i, (t, _) in enumerate(host) if i != 2], place
        cancelled, reference = got[2][0], host[2][0]
        assert cancelled == reference[:len(cancelled)] and len(reference) - len(cancelled) <= (place != "device")


def test_min_tokens_and_ignore_eos_hold_eos_back_per_row(small_modules):
    """EOS made the token a sequence reads at step 4: alone it stops there; beside it, in the same steps,
    min_tokens=9 generates at least 9 tokens and no EOS among them, ignore_eos exactly max_tokens, and a row
    without either reads as it does alone. All agree token for token up to where EOS was held back."""
    _, decoder = small_modules
    prompts = _prompts(decoder, [9, 14, 11], seed=3)
    free = Generator(decoder, 4, eos_id=-1, rule=None, kv_tokens=256).generate(prompts, [30] * 3)
    eos = free[0].tokens[4]
    first = free[0].tokens.index(eos)
    alone = Generator(decoder, 4, eos_id=eos, rule=None, kv_tokens=256).generate(prompts, [30] * 3)
    assert alone[0].finish_reason == "stop" and len(alone[0].tokens) == first + 1
    gen = Generator(decoder, 4, eos_id=eos, rule=RepetitionRule(), kv_tokens=256)
    held, ignoring, plain = gen.generate([prompts[0], prompts[0], prompts[1]], [30, 24, 30], min_tokens=[9, 0, 0],
                                         ignore_eos=[False, True, False])
    assert eos not in held.tokens[:9] and len(held.tokens) - (held.finish_reason == "stop") >= 9
    assert held.tokens[:first] == ignoring.tokens[:first] == free[0].tokens[:first]
    assert ignoring.finish_reason == "length" and len(ignoring.tokens) == 24 and eos not in ignoring.tokens
    assert plain.tokens == alone[1].tokens and plain.finish_reason == alone[1].finish_reason
    # the first token too (chosen at prefill): EOS first, held back by min_tokens=1
    (at_once,) = Generator(decoder, 2, eos_id=free[2].tokens[0], rule=None, kv_tokens=256).generate([prompts[2]], [5])
    assert at_once.finish_reason == "stop" and len(at_once.tokens) == 1
    (one,) = Generator(decoder, 2, eos_id=free[2].tokens[0], rule=None, kv_tokens=256).generate(
        [prompts[2]], [5], min_tokens=[1])
    assert one.tokens[0] != free[2].tokens[0] and len(one.tokens) >= 2


@torch.inference_mode()
def test_ignore_eos_outlasts_the_loop_detector_and_min_tokens_delays_it(small_modules):
    """A rule that calls everything a loop after 3 tokens: it stops a plain sequence at once, a min_tokens
    one at min_tokens, and never one that ignores EOS."""
    _, decoder = small_modules
    rule = RepetitionRule(ngram=0, max_period=0, fuzzy_window=3, fuzzy_gram=1, fuzzy_min_distinct=2.0)
    gen = Generator(decoder, 4, eos_id=-1, rule=rule, kv_tokens=256)
    plain, least, ignoring = gen.generate(_prompts(decoder, [9, 9, 9]), [20] * 3, [0, 7, 0], [False, False, True])
    assert (plain.finish_reason, len(plain.tokens)) == ("repetition", 3)
    assert (least.finish_reason, len(least.tokens)) == ("repetition", 7)
    assert (ignoring.finish_reason, len(ignoring.tokens)) == ("length", 20)


@pytest.mark.slow  # a bench subprocess (~32 s here)
def test_gpu_bench_tiny_runs_and_prints_its_json():
    # compiled at one sequence too: the three variants a GPU run compares (without graphs on a CPU)
    out = subprocess.run([sys.executable, "bench/gpu.py", "--tiny", "--threads", "1", "--compile-levels", "1"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["device"] == "cpu" and r["params"] > 0 and r["skipped"] == []
    assert set(r["encode"]) == {"1", "2"} and all(e["pages_per_s"] > 0 and e["tokens_per_page"] == 256
                                                  for e in r["encode"].values())
    assert set(r["decode"]["eager"]) == {"1", "4"} and r["decode"]["cuda_graph"] is None
    for d in r["decode"]["eager"].values():
        assert d["steps_timed"] == r["new_tokens"] - 3 and d["tokens_per_s"] > 0  # 1 from prefill, 2 warm-up
        assert 0 < d["tpot_ms_p50"] <= d["tpot_ms_p99"] and d["prefill_s"] > 0 and d["kv_gb"] > 0
    for mode in ("compiled", "compiled_gemm", "compiled_grouped"):
        assert set(r["decode"][mode]) == {"1"} and r["decode"][mode]["1"]["tokens_per_s"] > 0, r["decode"][mode]
    for mode, by_rows in r["timeline"].items():  # each part of a step at 4 rows, as a GPU run reports it at 128
        t = by_rows["4"]
        assert t["rows"] == 4 and 0 < t["rows_running_mean"] <= 4, (mode, t)
        assert all(0 < t[part]["p50"] <= t[part]["p90"] for part in ("forward_ms", "host_ms", "detokenise_ms", "step_wall_ms"))


def test_the_grouped_gemm_is_trusted_on_cuda_only_where_it_is_one_kernel(monkeypatch):
    """Elsewhere torch loops over the groups with their offsets on the host, which a graph cannot capture
    (fp32 on an H200 failed so, before this check)."""
    from ocr_latent.decoder import grouped_mm_works
    monkeypatch.setattr(decoder_module, "_GROUPED", {})
    assert grouped_mm_works(torch.device("cpu"), torch.float32)

    def probe(*a, **k):  # the fallback runs, so a probe would pass: these must be refused before probing
        raise AssertionError("probed")
    monkeypatch.setattr(torch, "_grouped_mm", probe)
    assert not grouped_mm_works(torch.device("cuda"), torch.float32)
    assert not grouped_mm_works(torch.device("cuda"), torch.float16)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert not grouped_mm_works(torch.device("cuda"), torch.bfloat16)  # an A100: no grouped kernel


def test_a_step_whose_capture_fails_runs_eagerly_with_the_same_tokens(small_modules, caplog):
    _, decoder = small_modules
    prompts = _prompts(decoder, [9, 14])
    expected = [s.tokens for s in Generator(decoder, 2, eos_id=-1, rule=None, kv_tokens=128).generate(prompts, [12, 12])]
    gen = Generator(decoder, 2, eos_id=-1, rule=None, kv_tokens=128)
    gen.cuda_graphs = True  # as on CUDA, where the capture below is refused

    def refuse(B, L, hold_eos=False):
        raise RuntimeError("Cannot copy between CPU and CUDA tensors during CUDA graph capture")
    gen._capture = refuse
    assert [s.tokens for s in gen.generate(prompts, [12, 12])] == expected
    assert not gen.cuda_graphs and "capture of a (2, " in caplog.text


REFERENCE = ROOT / "tests" / "data" / "reading-reference.json"


def read_reference_pages(pages: int = 32) -> list[list[int]]:
    """The tokens the embedded model reads from held-out pages through their codes, as the service does:
    two waves of 16 in one generator, fp32 prompts (bf16 ones would depend on this CPU's instructions)."""
    from ocr_latent.training.pages import test_pages
    from ocr_latent.serving.pipeline import load_pipeline
    pipe = load_pipeline(prefill_dtype="float32")
    stream = test_pages(seed=2)
    codes = pipe.encode([stream[i].image for i in range(pages)])
    gen, out = pipe.new_generator(16), []
    for i in range(0, pages, 16):
        out += [s.tokens for s in gen.generate([pipe.decode_inputs(c, "free") for c in codes[i:i + 16]], [512] * 16)]
    return out


@pytest.mark.slow  # reads 32 pages (~33 s here)
def test_pages_read_token_for_token_as_the_reference():
    """A change to the decode path must not change what is read: the reference was recorded when the decoder
    was checked token for token against its previous versions (256 pages). A CPU with other vector
    instructions may round a near-tie differently, so two of 32 pages may differ; this box gives all 32."""
    expected = json.loads(REFERENCE.read_text())["tokens"]
    got = read_reference_pages(len(expected))
    differ = [i for i, (a, b) in enumerate(zip(got, expected)) if a != b]
    assert len(differ) <= 2, f"pages {differ} read differently from tests/data/reading-reference.json"


@pytest.mark.slow  # reads 16 pages twice (~70 s here, on a loaded box)
def test_pages_read_the_same_with_the_rule_on_the_device_and_steps_overlapped():
    """The embedded model reading 16 held-out pages through their codes, as CUDA decodes (the ban inside the
    step, each step read back while the next runs) and as a CPU does (the host's rule, the implementation
    before): the same tokens and finish reasons. `python bench/token_agreement.py --variant device_rule
    --pages 256` runs this on 256 pages (docs/performance.md)."""
    from ocr_latent.training.pages import test_pages
    from ocr_latent.serving.pipeline import load_pipeline
    pipe = load_pipeline(prefill_dtype="float32")
    stream = test_pages(seed=2)
    inputs = [pipe.decode_inputs(c, "free") for c in pipe.encode([stream[i].image for i in range(16)])]
    read = lambda **options: [(s.tokens, s.finish_reason) for s in pipe.new_generator(16, **options).generate(inputs, [512] * 16)]
    host = read()
    assert read(**RULE_PLACES["device, overlapped"]) == host
    assert {"stop"} <= {reason for _, reason in host}


def test_prepare_runs_step_shapes_before_any_sequence_and_changes_no_tokens(small_modules):
    _, decoder = small_modules
    prompts = _prompts(decoder, [9, 14, 20])
    expected = [s.tokens for s in Generator(decoder, 4, eos_id=-1, rule=None, kv_tokens=256).generate(prompts, [12] * 3)]
    gen = Generator(decoder, 4, eos_id=-1, rule=None, kv_tokens=256)
    gen.prepare([(1, 30), (4, 60)])  # writes into free slots, which prefill overwrites
    assert [s.tokens for s in gen.generate(prompts, [12] * 3)] == expected
    gen.add(prompts[:1], [5])
    with pytest.raises(ValueError, match="before any sequence"):
        gen.prepare([(1, 30)])
