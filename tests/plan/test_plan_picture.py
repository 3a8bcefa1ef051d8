"""`vlm-sdk plan --html / --svg` (plan/picture.py) opened in a real headless Chromium, found and skipped as
tests/e2e/test_web_qa.py does: a screenshot taken, the memory bar's segments read from the page equal the
plan's numbers (bytes, and widths in proportion to the device's memory), the at-once curve's points the
cache's arithmetic, the workload's bins its shares; no console errors."""
from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

from helpers import TESTS
from vlm_sdk.cli import main
from vlm_sdk.plan import plan
from vlm_sdk.plan.picture import BAR_WIDTH

CONFIGS = TESTS / "configs"


def _workload(tmp_path):
    path = tmp_path / "w.jsonl"
    lines = [{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"width": 448, "height": 448}}]}],
              "max_tokens": 44, "prompt_tokens": 100}] * 3 + [{"messages": [], "max_tokens": 600, "prompt_tokens": 1000}]
    path.write_text("\n".join(json.dumps(x) for x in lines))
    return path


def _open(browser, path, shot):
    page = browser.new_page(viewport={"width": 1000, "height": 900})
    errors = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(path.as_uri())
    page.screenshot(path=str(shot), full_page=True)
    return page, errors


SEGMENTS = "Array.from(document.querySelectorAll('#memory-bar rect.segment')).map(r => ({name: r.dataset.name, " \
           "bytes: Number(r.dataset.bytes), width: r.getBBox().width, x: r.getBBox().x}))"


@pytest.mark.parametrize("config, extra", [("qwen2_5_vl_3b", dict(num_blocks=1000)),
                                           ("gemma3_4b_it", {})])  # one cache group; seven
def test_the_page_shows_the_plans_numbers(browser, tmp_path, config, extra):
    options = dict(device_memory="80GiB", dtype="bfloat16", max_num_seqs=64, workload=str(_workload(tmp_path)), **extra)
    p = plan(CONFIGS / f"{config}.json", **options)
    html = tmp_path / "plan.html"
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in options.items()]
    assert main(["plan", str(CONFIGS / f"{config}.json"), *flags, "--html", str(html), "--svg",
                 str(tmp_path / "plan.svg")]) == 0
    page, errors = _open(browser, html, tmp_path / "plan.png")
    assert (tmp_path / "plan.png").stat().st_size > 10_000 and errors == []
    segments = page.evaluate(SEGMENTS)
    by_name = {s["name"]: s["bytes"] for s in segments}
    assert by_name["weights: language model"] == p.weights_language_model_bytes
    assert by_name["weights: vision tower"] == p.weights_vision_bytes
    assert by_name["activation peak"] == p.activation_peak_bytes and by_name["encoder cache"] == p.encoder_cache_bytes
    assert sum(b for n, b in by_name.items() if n.startswith("KV")) == p.kv_cache_bytes
    assert len([n for n in by_name if n.startswith("KV")]) == max(1, len(p.cache_groups))
    total = p.device_memory_bytes  # the whole bar is the device; headroom is what the plan leaves
    assert sum(by_name.values()) == total
    assert by_name["headroom"] == total - p.weights_bytes - p.activation_peak_bytes - p.encoder_cache_bytes \
        - p.kv_cache_bytes - p.state_bytes
    x = 0.0
    for s in segments:  # each segment's width is its share of the bar, laid end to end
        assert s["width"] == pytest.approx(s["bytes"] / total * BAR_WIDTH, abs=1e-3)
        assert s["x"] == pytest.approx(x, abs=1e-3)
        x += s["width"]
    points = page.evaluate("Array.from(document.querySelectorAll('#at-once circle.point')).map(c => "
                           "[Number(c.dataset.tokens), Number(c.dataset.atOnce)])")
    assert [tuple(pt) for pt in points] == list(p.at_once_by_length) and points[-1][0] == p.longest_request_tokens
    if config == "qwen2_5_vl_3b":  # by hand: 1000 blocks of 16; 128 tokens = 8 blocks; 16,000 = all 1000
        assert points[0] == [128, 64] and points[-1] == [16_000, 1]
    bins = page.evaluate("Array.from(document.querySelectorAll('#workload rect.bin')).map(b => Number(b.dataset.share))")
    assert sum(bins) == pytest.approx(1) and len(bins) == 2  # 3/4 at 400 tokens, 1/4 at 1,600
    assert sorted(bins) == pytest.approx([0.25, 0.75], abs=1e-6)
    page.close()
    svg = ET.parse(tmp_path / "plan.svg").getroot()  # well-formed, the same bar inside
    rects = [r for r in svg.iter("{http://www.w3.org/2000/svg}rect") if r.get("class") == "segment"]
    assert [int(r.get("data-bytes")) for r in rects] == [s["bytes"] for s in segments]


def test_a_model_with_state_layers_shows_its_state_slots(tiny_checkpoints):
    from vlm_sdk.plan.picture import memory_segments
    p = plan(tiny_checkpoints("qwen3_5"), device_memory="2GiB", dtype="float32", num_blocks=64)
    segments = {name: size for name, _, size in memory_segments(p.to_dict())}
    assert p.state_bytes > 0 and segments["state slots"] == p.state_bytes
    assert sum(size for name, size in segments.items() if name.startswith("KV")) == p.kv_cache_bytes
    assert sum(segments.values()) == p.device_memory_bytes
