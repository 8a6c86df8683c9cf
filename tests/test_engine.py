"""The engine without HTTP: what a Ray deployment, a bench or a client test drives."""
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import ROOT
from ocr_latent.serving.engine import DecodeResult, Engine, EngineConfig, Overloaded, Unavailable
from ocr_latent.training.reading_metrics import cer
from ocr_latent.training.pages import test_pages


@pytest.fixture(scope="module")
def pages():
    stream = test_pages(seed=2)
    return [stream[i] for i in range(3)]


def test_importing_the_engine_pulls_in_no_web_framework():
    code = "import sys; from ocr_latent.serving import engine; print(sorted(m for m in ('fastapi', 'starlette', 'uvicorn') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_jobs_submitted_from_threads_read_their_pages(pages):
    engine = Engine(EngineConfig(torch_threads=1, decode_slots=4)).start()
    try:
        with pytest.raises(Unavailable):  # refused, not queued, while loading
            engine.encode(pages[0].image)
        with pytest.raises(Unavailable):
            engine.decode(np.zeros(4096, np.uint8))
        engine.wait_ready(60)
        encodes = [engine.encode(p.image) for p in pages]  # one batch through the towers
        codes = [j.future.result(60) for j in encodes]
        assert all(c.shape == (4096,) and c.max() <= 15 for c in codes)
        decodes = [engine.decode(c, "free", 256) for c in codes]
        results = [j.future.result(120) for j in decodes]
        assert all(isinstance(r, DecodeResult) and r.finish_reason == "stop" for r in results)
        mean_cer = sum(cer(r.text, p.text) for r, p in zip(results, pages)) / len(pages)
        assert mean_cer < 0.15, mean_cer  # measured 0.054 (nano v3.2; v3.1 read 0.075, v3 0.127, v1 0.049)
        with pytest.raises(ValueError, match="not available"):
            engine.decode(codes[0], "markdown")  # nano's tokenizer has no <|grounding|>
    finally:
        engine.stop()


def test_a_full_queue_refuses_and_a_cancelled_job_frees_its_slot(pages):
    engine = Engine(EngineConfig(torch_threads=1, decode_slots=1, max_queue=1, step_delay_s=0.05)).start()
    try:
        engine.wait_ready(60)
        codes = engine.encode(pages[0].image).future.result(60)
        running = engine.decode(codes, max_tokens=4000)  # takes the one slot for ~200 steps
        queued = engine.decode(codes, max_tokens=4)
        with pytest.raises(Overloaded, match="MAX_QUEUE"):
            engine.decode(codes, max_tokens=4)
        time.sleep(0.2)
        engine.cancel(running)
        assert queued.future.result(30).num_tokens <= 4  # got the slot the cancelled job left
        assert not running.future.done()  # nobody waits for a cancelled job: it is never resolved
    finally:
        engine.stop()


def byte_level_tokenizer():
    """A small byte-level BPE (DeepSeek-OCR's tokenizer is one): characters outside its merges are split
    into bytes, so a prefix of the tokens can end inside a character."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(["the page reads plain text"] * 10, trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def test_streamed_pieces_join_into_the_text_even_across_split_characters():
    from ocr_latent.serving.engine import TextStream
    tok = byte_level_tokenizer()
    text = "  Größe: 漢字 and  spaces\n\ttabs — the page  "
    ids = tok.encode(text).ids
    decode = lambda t: tok.decode(t, skip_special_tokens=False)
    assert decode(ids) == text and any(decode(ids[:n]).endswith("\ufffd") for n in range(len(ids)))
    stream = TextStream(decode)
    pieces = [stream.feed(ids[:n]) for n in range(1, len(ids) + 1)]
    pieces.append(stream.finish(text.strip()))  # the pipeline's text is stripped
    assert "".join(pieces) == text.strip()
    assert not any("\ufffd" in p for p in pieces)
    assert sum(bool(p) for p in pieces) > 10  # it streams, not all at the end


def test_the_kv_cache_is_sized_once_and_requests_that_cannot_fit_are_refused(pages):
    import numpy as np
    slot = 400
    engine = Engine(EngineConfig(torch_threads=1, decode_slots=2, kv_cache_tokens=2 * slot)).start()
    try:
        engine.wait_ready(60)
        cache = engine.gen.cache
        k, v, shape = cache.k.data_ptr(), cache.v.data_ptr(), tuple(cache.k.shape)
        # DECODE_SLOTS x KV_CACHE_TOKENS / DECODE_SLOTS positions (and one spare that no step reads)
        assert shape[1] == 2 and cache.length == slot and shape[3] == slot + 1
        most = engine.max_new_tokens("free")
        assert most == slot - engine.pipeline.prompt_length("free") > 0
        codes = engine.encode(pages[0].image).future.result(60)
        with pytest.raises(ValueError, match=f"at most {most}"):
            engine.decode(codes, "free", most + 1)
        # long requests (random codes read on and on), two at once, up to the slot's end
        noise = [np.random.default_rng(i).integers(0, 16, 4096).astype(np.uint8) for i in range(2)]
        results = [j.future.result(300) for j in [engine.decode(c, "free", most) for c in noise]]
        assert all(r.num_tokens <= most for r in results)
        assert engine.decode(codes, "free", most).future.result(60).text  # still reads after them
        assert (engine.gen.cache.k.data_ptr(), engine.gen.cache.v.data_ptr(), tuple(engine.gen.cache.k.shape)) == \
            (k, v, shape)
    finally:
        engine.stop()


def test_min_tokens_and_ignore_eos_read_on_past_the_end_and_are_refused_beyond_a_slot(pages):
    slot = 600  # the page and prompt take 284
    engine = Engine(EngineConfig(torch_threads=1, decode_slots=4, kv_cache_tokens=4 * slot)).start()
    try:
        engine.wait_ready(60)
        codes = engine.encode(pages[0].image).future.result(60)
        plain = engine.decode(codes, "free", 300).future.result(120)
        assert plain.finish_reason == "stop" and plain.num_tokens < 250
        n = plain.num_tokens + 20
        jobs = [engine.decode(codes, "free", n, ignore_eos=True), engine.decode(codes, "free", 300, min_tokens=n),
                engine.decode(codes, "free", 300, min_tokens=5)]  # together, in one batch
        ignoring, least, early = [j.future.result(120) for j in jobs]
        assert (ignoring.finish_reason, ignoring.num_tokens) == ("length", n)
        assert least.num_tokens >= n and ignoring.text.startswith(plain.text) and least.text.startswith(plain.text)
        assert early == plain  # a min_tokens the reading passes anyway changes nothing
        most = engine.max_new_tokens("free")
        for lengths, says in ((dict(max_tokens=10, min_tokens=11), "min_tokens=11 is more than max_tokens=10"),
                              (dict(max_tokens=most + 1, min_tokens=most + 1), f"min_tokens={most + 1} does not fit"),
                              (dict(min_tokens=-1), "give 0 or more")):
            with pytest.raises(ValueError, match=says):
                engine.decode(codes, "free", **lengths)
    finally:
        engine.stop()


@pytest.mark.slow  # torch.compile (~16 s here)
def test_compiled_decode_steps_read_what_eager_ones_read(pages):
    """COMPILE=1: the steps go through torch.compile (compiled during warm-up, so no request waits for it)
    and the pages read exactly as without it."""
    texts = {}
    for compile in (False, True):
        engine = Engine(EngineConfig(torch_threads=1, decode_slots=4, compile=compile)).start()
        try:
            engine.wait_ready(300)
            if compile:  # compiled for real, not fallen back to eager (a missing C++ compiler, say)
                assert engine.gen._decode_step != engine.gen.decoder.decode_step
            codes = [engine.encode(p.image).future.result(60) for p in pages]
            jobs = [engine.decode(c, "free", 256) for c in codes]
            texts[compile] = [j.future.result(120).text for j in jobs]
        finally:
            engine.stop()
    assert texts[True] == texts[False]


def test_overlapped_steps_with_the_rule_on_the_device_serve_what_the_cpus_steps_serve(pages, monkeypatch):
    """As the engine decodes on CUDA (the n-gram ban inside the step, each step's tokens read back while the
    next runs), here on the CPU: the same texts, token counts, finish reasons and streamed text for pages
    decoded together in 2 slots (others wait, join and leave), one cut short by max_tokens."""
    from ocr_latent.serving.pipeline import Pipeline
    new_generator = Pipeline.new_generator
    served = {}
    for overlap in (False, True):
        options = {"device_rule": True, "overlap": True} if overlap else {}
        monkeypatch.setattr(Pipeline, "new_generator", lambda self, *a, **k: new_generator(self, *a, **k, **options))
        engine = Engine(EngineConfig(torch_threads=1, decode_slots=2)).start()
        try:
            engine.wait_ready(60)
            assert engine.gen.overlap == overlap
            codes = [engine.encode(p.image).future.result(60) for p in pages]
            pieces = [[] for _ in codes]
            jobs = [engine.decode(c, "free", 40 if i == 1 else 256, on_text=pieces[i].append) for i, c in enumerate(codes)]
            served[overlap] = [(j.future.result(120), "".join(p)) for j, p in zip(jobs, pieces)]
        finally:
            engine.stop()
    assert served[True] == served[False]
    assert [r.finish_reason for r, _ in served[False]] == ["stop", "length", "stop"]
    assert all(text == r.text for r, text in served[False])


def wait_until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the engine did not get there in time"
        time.sleep(0.01)


def test_requests_take_turns_at_the_decode_slots_and_a_lone_page_finds_one_free_while_files_decode():
    """Fair turns (issue 52): two requests of more pages than there are slots, the second's all queued
    behind the first's, share the slots; and a lone short page of a third request decodes at once, in the
    slot kept for requests with nothing running, rather than waiting for the files (first come first
    served: until its deadline)."""
    engine = Engine(EngineConfig(torch_threads=1, decode_slots=4, step_delay_s=0.05)).start()
    pages = {}
    try:
        engine.wait_ready(60)
        codes = np.zeros(4096, np.uint8)
        files = {"a": object(), "b": object()}
        endless = dict(max_tokens=engine.max_new_tokens("free"), ignore_eos=True)  # ~7,900 steps: minutes
        with engine.cv:  # the worker sees them all at once, "a"'s six pages first
            pages = {name: [engine.decode(codes, group=group, **endless) for _ in range(6)]
                     for name, group in files.items()}
        wait_until(lambda: len(engine.running) >= 3)
        t0 = time.monotonic()
        lone = engine.decode(codes, max_tokens=8).future.result(10)
        assert lone.num_tokens <= 8 and time.monotonic() - t0 < 5
        holding = sorted(sum(j in engine.running for j in jobs) for jobs in pages.values())
        assert holding == [1, 2] and engine.gen.capacity == 1  # the last slot kept free, for the next lone page
    finally:
        for job in [j for jobs in pages.values() for j in jobs]:
            engine.cancel(job)
        engine.stop()


def test_a_decode_that_could_only_time_out_waiting_for_a_slot_is_refused_at_once():
    """Every slot held by a sequence that cannot end before a new decode's deadline (ignore_eos, or min_tokens,
    at the steps' measured pace): a 503 (Overloaded) at submit, not a 504 at the deadline. Sequences that
    may end at any step (EOS) refuse nothing, and neither do ones reaped by their own deadline in time."""
    engine = Engine(EngineConfig(torch_threads=1, decode_slots=2, step_delay_s=0.05)).start()
    running = []
    try:
        engine.wait_ready(60)
        most = engine.max_new_tokens("free")
        noise = np.random.default_rng(0).integers(0, 16, 4096).astype(np.uint8)  # reads on and on

        def fill(**lengths):
            for job in running:
                engine.cancel(job)
            running[:] = [engine.decode(noise, max_tokens=most, **lengths) for _ in range(2)]
            wait_until(lambda: all(j.seq is not None and len(j.seq.tokens) > 3 for j in running)
                       and engine.step_s is not None and engine.gen.capacity == 0)

        for certain in (dict(ignore_eos=True), dict(min_tokens=most)):  # ~7,900 steps of 0.05 s and more
            fill(**certain)
            with pytest.raises(Overloaded, match="could only time out") as refused:
                engine.decode(noise, max_tokens=8, timeout_s=5)
            assert refused.value.retry_after_s > 100 and not engine.decodes  # nothing queued
            # the running ones are reaped at their deadline (120 s, REQUEST_TIMEOUT_S), before this one's
            waits = engine.decode(noise, max_tokens=8, timeout_s=200)
            engine.cancel(waits)
        fill()
        waits = engine.decode(noise, max_tokens=8, timeout_s=5)  # EOS may end a running one at any step
        assert not waits.future.done()  # queued (or, had a running one just ended, decoding)
        engine.cancel(waits)
    finally:
        for job in running:
            engine.cancel(job)
        engine.stop()


def test_a_second_file_arriving_later_leaves_the_reserve_to_lone_pages():
    """One file holds all but the reserve; a second file arrives: it may not take the reserved slot (it has
    pages to come), which a lone page then gets at once."""
    from collections import Counter

    from ocr_latent.serving.engine import DecodeJob
    engine = Engine.__new__(Engine)
    engine.reserve = 1
    first, second = object(), object()
    page = lambda group: DecodeJob(codes=np.zeros(4096, np.uint8), prompt="free", max_tokens=8, deadline=0.0,
                                   group=group)
    held = Counter({id(first): 3})  # 4 slots: the first file holds 3
    assert engine._fair_turn([page(second) for _ in range(8)], 1, held) == []
    lone = page(None)
    assert [j for j, _ in engine._fair_turn([*[page(second) for _ in range(8)], lone], 1, held)] == [lone]
