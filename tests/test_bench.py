"""bench/gpu_suite.sh, the first GPU hour's run, at tiny sizes on the CPU: every section runs and leaves its
JSON with figures that add up (a GPU run is `bash bench/gpu_suite.sh`, docs/gpu.md)."""
import json
import subprocess
import sys

import pytest

from conftest import ROOT


@pytest.mark.slow  # every section: two services (one compiling), a trainer, torch.compile (~3 min here)
def test_the_gpu_suite_runs_every_section_at_tiny_sizes(tmp_path):
    out = subprocess.run(["bash", "bench/gpu_suite.sh", "--tiny", "--out", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    suite = json.loads(out.stdout.strip().splitlines()[-1])
    assert suite == json.loads((tmp_path / "suite.json").read_text())
    loads = [f"load_{t}_{c}" for t in (8, 16) for c in (1, 2)] + [f"eager_load_8_{c}" for c in (1, 2)]
    names = ["checkpoint", "serve_compiled", *loads[:4], "encode", "serve_eager", *loads[4:], "gpu_bench", "quantizer",
             "agreement"]
    assert [s["name"] for s in suite["sections"]] == names
    assert all(s["status"] == "ok" for s in suite["sections"]), suite["sections"]
    assert suite["tiny"] and (tmp_path / "commit.txt").read_text().startswith(suite["commit"])
    read = lambda name: json.loads((tmp_path / f"{name}.json").read_text())
    assert read("checkpoint")["params"] > 0 and read("checkpoint")["checkpoint_gb"] > 0
    for name, compile in (("serve_compiled", "1"), ("serve_eager", "0")):
        served = read(name)
        assert served["time_to_healthy_s"] > 0 and served["health"]["status"] == "ok", served
        assert served["settings"]["COMPILE"] == compile and served["warmup_s"] is not None
    for name in loads:
        (level,) = read(name)["levels"]
        tokens, n = int(name.split("_")[-2]), level["requests"]
        assert level["succeeded"] == n and level["errors"] == {} and level["exact_lengths"] == n, level
        assert level["output_tokens"] == n * tokens and level["output_tokens_per_s"] > 0
        assert 0 < level["ttft_ms"]["p50"] <= level["latency_ms"]["p50"] and level["tpot_ms"]["p50"] > 0
    (encoded,) = read("encode")["levels"]
    assert encoded["pages"] == encoded["requests"] == 4 and encoded["pages_per_s"] > 0 and encoded["errors"] == {}
    bench = read("gpu_bench")
    assert bench["decode"]["eager"]["1"]["tokens_per_s"] > 0 and bench["skipped"] == ["healthy"]  # the service was timed
    assert set(bench["timeline"]) == {"host_rule", "device_rule", "device_rule_overlap"}
    for by_rows in bench["timeline"].values():
        assert all(by_rows["4"][part]["p50"] > 0 for part in ("forward_ms", "host_ms", "detokenise_ms", "step_wall_ms"))
    trained = read("quantizer")
    assert trained["feature_cache"]["pages_per_s"] > 0 and trained["largest_batch"] == 4
    assert [(r["batch"], r["rc"]) for r in trained["runs"]] == [(2, 0), (4, 0)]
    assert all(r["sec_per_step"] > 0 and r["steps"] == 2 for r in trained["runs"])
    agreed = read("agreement")
    assert agreed["ok"] and set(agreed["dtypes"]) == {"float32", "bf16"}
    assert agreed["dtypes"]["float32"]["identical_pages"] == agreed["dtypes"]["float32"]["pages"] == 2
    assert set(suite["headline"]) >= {"serve_compiled_healthy_s", "encode_pages_per_s", "timeline", "quantizer", "agreement"}


def test_the_curriculum_levels_bench_reads_the_small_pages_and_not_level_0(nano_v1):
    """bench/curriculum_levels.py on nano v1: its own small pages read (CER well under 0.5),
    the 40-56 px ordinary pages of the curriculum's level 0 not (its layout is new to v1): the figures
    docs/training.md gives for the v3 run's start."""
    out = subprocess.run([sys.executable, "bench/curriculum_levels.py", str(nano_v1), "--levels", "small,0", "--pages", "2",
                          "--max-tokens", "256", "--split-at", "48", "--by-line", "--show", "2"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    levels = json.loads(out.stdout.strip().splitlines()[-1])["levels"]
    assert levels["small"]["cer"] < 0.5 < levels["0"]["cer"] and levels["0"]["chars"] > levels["small"]["chars"]
    # by glyph size: v1's small pages (22-30 px) are all under 48 px; every page is in one band
    assert levels["small"]["under 48 px"] == {"pages": 2, "cer": levels["small"]["cer"]}
    assert levels["0"]["under 48 px"]["pages"] + levels["0"]["48 px and over"]["pages"] == 2
    # line by line: each line of the pages read as many lines as they have, in one of the two kinds
    from ocr_latent.training.pages import level_pages, lines_sharing_a_row, load_corpus, split_documents

    pages = level_pages(split_documents(load_corpus())["val"], "small", 2, 9)
    by_line = levels["small"]["by_line"]
    counted = by_line["lines sharing a token row"]["lines"] + by_line["lines with a token row to themselves"]["lines"]
    assert 1 <= by_line["pages_paired"] <= 2 and counted <= sum(len(p.lines) for p in pages)
    assert counted in {len(p.lines) for p in pages} | {sum(len(p.lines) for p in pages)}
    assert [len(lines_sharing_a_row(p)) for p in pages] == [len(p.lines) for p in pages]
    # --show: lines of the pages, each of the kind it is shown as, at most 2 of a kind
    for kind, shown in by_line["shown"].items():
        assert len(shown) == min(2, by_line[kind]["lines"])
        for row in shown:
            assert any(row["written"] == line and shares == (kind == "lines sharing a token row")
                       for p in pages for line, shares in zip(p.lines, lines_sharing_a_row(p)))


def test_the_curriculum_levels_bench_reads_teacher_forced_by_kind_of_line(nano_v1):
    """--teacher-forced: v1 predicts most characters of its own small pages right given the text before them, every
    character but spaces and line ends counted once in one kind of line; level-0 pages with Latin-1 letters, which
    v1's tokenizer cannot write one token a character, are left out and counted, not misread."""
    from bench.curriculum_levels import teacher_forced_by_line
    from ocr_latent.checkpoint import load_model
    from ocr_latent.training.pages import LINE_KINDS, level_pages, load_corpus, split_documents

    model, docs = load_model(str(nano_v1)), split_documents(load_corpus())["val"]
    pages = level_pages(docs, "small", 3, 21)
    read = teacher_forced_by_line(model, pages)
    assert read["pages_left_out"] == 0
    assert sum(read[kind]["chars"] for kind in LINE_KINDS) == sum(1 for p in pages for ch in p.text if ch not in " \n")
    assert read[LINE_KINDS[1]]["right"] > 0.8
    latin1 = [p for p in level_pages(docs, 0, 12, 21) if any(ord(ch) > 126 for ch in p.text)]
    assert latin1  # level 0 has pages v1 cannot spell
    assert teacher_forced_by_line(model, latin1[:1]) == {"pages_left_out": 1,
                                                         **{kind: {"chars": 0, "right": None} for kind in LINE_KINDS}}


def test_lines_sharing_a_row_of_tokens_are_told_from_lines_with_a_row_to_themselves():
    from PIL import Image

    from ocr_latent.training.pages import lines_sharing_a_row
    from ocr_latent.training.pages import Page

    # a 1024 px page, 64 px token rows; with the field shift (24 px) row 1 holds middles 40-104 px down:
    # "ab" at 46 and "cd" at 98 share it, "ef" at 200 has row 3 to itself
    boxes = [(ch, x, y - 10, x + 20, y + 10) for ch, x, y in
             (("a", 10, 46), ("b", 40, 46), ("c", 10, 98), ("d", 40, 98), ("e", 10, 200), ("f", 40, 200))]
    page = Page(image=Image.new("RGB", (1024, 1024)), text="ab\ncd\nef", lines=["ab", "cd", "ef"], char_boxes=boxes,
                font="DejaVuSans", font_size=20, source="x")
    assert lines_sharing_a_row(page) == [True, True, False]


def test_the_pointer_heads_bench_finds_the_head_v1_reads_with(capsys, nano_v1):
    """v1's decoder learned a pointer of its own: a head of its last layer looks at the token showing the character
    it writes for most characters; no head of layer 1 does. Every character a token shows is counted once, as
    on a line sharing a token row or on one with a row to itself."""
    from bench.pointer_heads import main as pointer_heads
    from ocr_latent.training.pages import level_pages, load_corpus, split_documents
    pointer_heads([str(nano_v1), "--level", "small", "--pages", "3"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    heads = report["heads"]
    assert len(heads) == 3 and all(len(row) == 4 for row in heads)
    assert max(heads[1]) < 0.05 and max(heads[2]) > 0.5
    last = report["best"][f"layer 2, head {heads[2].index(max(heads[2]))}"]
    pages = level_pages(split_documents(load_corpus())["val"], "small", 3, 21)
    assert last["all"]["chars"] == sum(1 for p in pages for ch in p.text if ch not in " \n")
    assert last["lines sharing a token row"]["chars"] + last["lines with a token row to themselves"]["chars"] == last["all"]["chars"]


def test_the_pointer_heads_bench_measures_a_line_pointer_s_targets(capsys, nano_v1):
    """--second-lines scores each head against a line pointer's targets: the token for the characters of the lower
    of two lines sharing it, BOS for every other character. v1 was never taught one: its pointer head finds the
    lower lines' tokens, as it finds every character's, and no head of it rests on BOS."""
    from bench.pointer_heads import main as pointer_heads
    pointer_heads([str(nano_v1), "--level", "small", "--pages", "3", "--seed", "53", "--second-lines"])  # pages with two lines sharing a row
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    last = next(best for name, best in report["best"].items() if name.startswith("layer 2,"))
    lower, bos = last["the lower line's token"], last["BOS"]
    assert lower["chars"] > 0 and lower["chars"] + bos["chars"] == last["all"]["chars"]
    assert lower["accuracy"] > 0.3 and bos["accuracy"] < 0.5
    assert all(layer["BOS"]["accuracy"] < 0.5 for layer in report["best"].values())
