"""The family spec contract: every registered family provides its settings schema, classes, planner
hooks, tiny checkpoint and transformers reference; shared types carry family settings as opaque
options, routed and checked through the registry; importing the registry imports no family."""
from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from vlm_sdk.testing.families import fixtures
from vlm_sdk.config import EngineArgs
from vlm_sdk.errors import InvalidRequestError, UnknownArgumentError
from vlm_sdk.models import registry
from vlm_sdk.models.family import FamilySpec, Setting
from vlm_sdk.multimodal.messages import parse_messages

FAMILIES = registry.family_names()


def test_importing_the_registry_imports_no_family():
    code = ("import sys, vlm_sdk.models.registry as r; r.supported_architectures(); "
            "print(sorted(m for m in sys.modules if m.startswith('vlm_sdk.models.') and m.count('.') >= 3))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


@pytest.mark.parametrize("name", FAMILIES)
def test_every_family_provides_the_spec(name):
    fam = registry.load(name)
    assert isinstance(fam, FamilySpec) and fam.name == name and fam.display_name
    entry = next(e for e in registry.FAMILIES if e.name == name)
    assert registry.resolve([entry.architectures[0]]) is fam
    assert all(isinstance(s, Setting) and s.help for s in fam.engine_settings + fam.image_settings)
    option, setting = fam.plan_setting
    assert setting in {s.name for s in fam.engine_settings} and option == setting  # one vocabulary (issue 20)
    for cls in (fam.model_cls, fam.processor_cls, fam.image_processor_cls):
        assert isinstance(cls, type)
    assert fam.model_cls.position_rows in (1, 3)
    fixture = fixtures(name)  # tests and benchmarks only: registered in vlm_sdk/testing/families.py
    assert fixture.family == name
    assert fixture.bench_image_sizes and all(w > 0 and h > 0 for w, h in fixture.bench_image_sizes)
    assert callable(fixture.reference.hf_prompt) and callable(fixture.reference.hf_image_processor)
    assert not hasattr(fam, "make_tiny_checkpoint") and not hasattr(fam, "reference")  # runtime hooks only


def test_position_rows_per_family():
    assert registry.load("qwen2_5_vl").model_cls.position_rows == 3  # M-RoPE t/h/w
    assert registry.load("internvl").model_cls.position_rows == 1


def test_engine_args_route_family_settings_into_the_options_mapping():
    args = registry.engine_args(max_pixels=200_704, num_blocks=8)
    assert dict(args.mm_processor_kwargs) == {"max_pixels": 200_704} and args.num_blocks == 8
    assert dict(registry.engine_args(max_dynamic_patch=None).mm_processor_kwargs) == {}
    with pytest.raises(UnknownArgumentError, match="max_pixels"):  # accepted names are listed
        registry.engine_args(max_pixel=1)
    with pytest.raises(UnknownArgumentError):  # without the registry's names, no family setting exists
        EngineArgs.from_kwargs(max_pixels=1)
    with pytest.raises(InvalidRequestError, match="max_pixels must be a positive integer") as info:
        registry.engine_args(max_pixels=0)
    assert info.value.param == "max_pixels"
    with pytest.raises(InvalidRequestError, match="max_dynamic_patch must be an integer from 1 to 256"):
        registry.engine_args(max_dynamic_patch=1000)


def test_a_family_refuses_another_familys_setting_naming_it_and_its_own():
    qwen, internvl = registry.load("qwen2_5_vl"), registry.load("internvl")
    with pytest.raises(InvalidRequestError) as info:
        qwen.engine_options({"max_dynamic_patch": 2})
    msg = str(info.value)
    for word in ("max_dynamic_patch=2", "Qwen2.5-VL", "qwen2_5_vl", "min_pixels, max_pixels", "InternVL"):
        assert word in msg, msg
    assert info.value.param == "max_dynamic_patch"
    with pytest.raises(InvalidRequestError, match="image 1: min_pixels is not an image setting of InternVL.*max_num"):
        internvl.image_options({"min_pixels": 3136}, "image 1: ")
    # a key no family declares is ignored, as OpenAI and vLLM ignore unknown keys of an image part
    assert qwen.image_options({"colour": "red", "uuid": "x", "max_pixels": 3136}, "image 0: ") == {"max_pixels": 3136}
    assert internvl.image_options({"colour": "red"}, "image 0: ") == {}
    assert qwen.image_options({"max_pixels": 3136, "min_pixels": None}, "") == {"max_pixels": 3136}
    # engine settings stay strict: the operator's typo is never ignored
    with pytest.raises(InvalidRequestError, match="colour=.red. is not an engine setting of Qwen2.5-VL"):
        qwen.engine_options({"colour": "red"})


def test_image_parts_carry_their_other_keys_as_options():
    _, refs = parse_messages([{"role": "user", "content": [
        {"type": "image", "image": "a.png", "max_pixels": 100},
        {"type": "image_url", "image_url": {"url": "data:x", "detail": "low", "max_num": 3}, "min_pixels": 5},
        {"type": "image_url", "image_url": {"url": "data:y"}}]}])
    assert [dict(r.options) for r in refs] == [{"max_pixels": 100}, {"max_num": 3, "min_pixels": 5}, {}]
    assert refs[1].source == "data:x"


def test_server_flags_come_from_the_family_schemas():
    from vlm_sdk.server.cli import add_engine_flags, engine_kwargs
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    for fam in registry.families():
        for s in fam.engine_settings:
            flag = f"--{s.name.replace('_', '-')}"
            if s.type is bool:  # a switch: --name / --no-name
                for argv, value in (([flag], True), ([f"--no-{flag[2:]}"], False)):
                    assert engine_kwargs(parser.parse_args(argv)) == {s.name: value}
                    assert dict(registry.engine_args(**{s.name: value}).mm_processor_kwargs) == {s.name: value}
                continue
            args = parser.parse_args([flag, "4"])
            assert engine_kwargs(args) == {s.name: 4}
            assert dict(registry.engine_args(**engine_kwargs(args)).mm_processor_kwargs) == {s.name: 4}


def test_plan_flags_come_from_the_family_schemas():
    from vlm_sdk.plan import FAMILY_OPTIONS, PLAN_OPTIONS
    assert set(FAMILY_OPTIONS) == {f.plan_setting[0] for f in registry.families()} <= set(PLAN_OPTIONS)


def test_a_new_family_is_one_registry_line(tiny_ckpt, tmp_path, monkeypatch):
    """A family registered by one `FamilyEntry` (its spec module found by path) serves a checkpoint
    through the engine and the planner, with no edit to either."""
    import json
    import shutil
    import types

    from vlm_sdk import LLM, SamplingParams
    from vlm_sdk.models.qwen2_5_vl.spec import Qwen2_5_VLSpec
    from vlm_sdk.plan import plan

    class NewSpec(Qwen2_5_VLSpec):  # a family reusing Qwen2.5-VL's parts under new names
        name, display_name = "newvl", "NewVL"

    module = types.ModuleType("newvl_spec")
    module.FAMILY = NewSpec()
    monkeypatch.setitem(sys.modules, "newvl_spec", module)
    monkeypatch.setattr(registry, "FAMILIES", registry.FAMILIES + (
        registry.FamilyEntry("newvl", "newvl_spec", ("NewVLForConditionalGeneration",)),))
    ckpt = tmp_path / "newvl"
    shutil.copytree(tiny_ckpt, ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "architectures": ["NewVLForConditionalGeneration"]}))

    assert registry.resolve(["NewVLForConditionalGeneration"]) is module.FAMILY
    p = plan(ckpt, device="cpu", num_blocks=64, max_pixels=28 * 28 * 16)
    assert p.family == "newvl" and p.image_tokens_per_image == 16
    conv = [{"role": "user", "content": "Say something."}]
    params = SamplingParams(max_tokens=4, temperature=0.0)
    ours = LLM(ckpt, num_blocks=64, max_pixels=28 * 28 * 16, show_progress=False)
    assert ours.engine.memory_report.image_tokens_per_image == p.image_tokens_per_image  # plan == engine
    qwen = LLM(tiny_ckpt, num_blocks=64, max_pixels=28 * 28 * 16, show_progress=False)
    assert ours.chat(conv, params)[0].token_ids == qwen.chat(conv, params)[0].token_ids


def test_shared_code_names_no_family():
    """The engine, planner, server, client, config and multimodal types reach families only through
    the registry: no family name or family setting appears in their code (names and strings)."""
    import re
    from pathlib import Path

    import vlm_sdk
    from vlm_sdk import kernels
    root = Path(vlm_sdk.__file__).parent
    # every shared module: all of vlm_sdk/ but the benchmarks (the GPU bench is a Qwen2.5-VL-3B figure by
    # design) and the test fixtures, plus the family-neutral parts of models/ and all of kernels/; the
    # engine bench (`vlm-sdk bench --family F`) serves every family, so it is shared code too
    models = Path(registry.__file__).parent
    files = [p for p in root.rglob("*.py") if p.relative_to(root).parts[0] not in ("bench", "testing")]
    files += [root / "bench" / "engine.py"]
    files += [models / "base.py", models / "family.py", *(models / "common").glob("*.py"),
              *Path(kernels.__file__).parent.glob("*.py")]
    words = {s.name for f in registry.families() for s in f.engine_settings + f.image_settings}
    words |= {f.name for f in registry.families()} | {f.display_name for f in registry.families()}
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, sorted(words))) + r")\b", re.IGNORECASE)
    hits = [f"{p}:{line}: {text!r}" for p in files for line, text in _code_words(p)
            if pattern.search(text) and (p.name, text) not in LIBRARY_WORDS]
    assert not hits, "\n".join(hits)


# a library's own names that a family setting shares: FFmpeg's decoder option (AVCodecContext.max_pixels)
LIBRARY_WORDS = {("video_container.py", "max_pixels")}


def _code_words(path) -> list[tuple[int, str]]:
    """(line, text) of every name and string literal in a module's code; comments and docstrings are
    prose and may cite a family as an example."""
    import ast
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant) and isinstance(node.body[0].value.value, str)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            out.append((node.lineno, node.value))
        elif isinstance(node, ast.Name):
            out.append((node.lineno, node.id))
        elif isinstance(node, ast.Attribute):
            out.append((node.lineno, node.attr))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.append((node.lineno, node.name))
        elif isinstance(node, ast.arg):
            out.append((node.lineno, node.arg))
        elif isinstance(node, ast.alias):
            out.append((node.lineno, node.name))
    return out


def test_a_family_setting_given_twice_must_agree():
    """By name and in mm_processor_kwargs: the same value is one setting, different values are refused."""
    args = registry.engine_args(max_pixels=200_704, mm_processor_kwargs={"max_pixels": 200_704})
    assert dict(args.mm_processor_kwargs) == {"max_pixels": 200_704}
    with pytest.raises(InvalidRequestError, match=r"max_pixels is set twice.*max_pixels=100352.*200704") as e:
        registry.engine_args(max_pixels=100_352, mm_processor_kwargs={"max_pixels": 200_704})
    assert e.value.param == "max_pixels"
    with pytest.raises(InvalidRequestError, match="mm_processor_kwargs must be a mapping"):
        registry.engine_args(mm_processor_kwargs=[("max_pixels", 1)])


def test_a_setting_several_families_declare_has_a_help_true_for_each():
    """`--max-pixels` is Qwen2.5-VL's (28x28 cells) and Qwen3-VL's (32x32): the flag names both units,
    each beside its family, and says the common part once."""
    max_pixels = registry.engine_settings()["max_pixels"].help
    owners = [f for f in registry.families() if "max_pixels" in {s.name for s in f.engine_settings}]
    assert len(owners) >= 2
    for fam in owners:
        own = next(s for s in fam.engine_settings if s.name == "max_pixels")
        assert f"{own.detail} ({fam.display_name}" in max_pixels or f", {fam.display_name}" in max_pixels
    assert max_pixels.count("resized to at most") == 1
    assert "28x28 pixels (Qwen2.5-VL)" in max_pixels and "32x32 pixels (Qwen3-VL" in max_pixels


def test_shared_setting_merges_details_and_keeps_differing_helps_apart():
    class A:
        display_name = "A"

    class B:
        display_name = "B"

    class C:
        display_name = "C"
    same = Setting("n", "count", detail="even")
    assert registry.shared_setting([(A, same)]).help == "count; even"
    assert registry.shared_setting([(A, same), (B, same)]).help == "count; even"
    odd = Setting("n", "count", detail="odd", maximum=9)
    merged = registry.shared_setting([(A, same), (B, odd), (C, same)])
    assert merged.help == "count; even (A, C); odd (B)" and merged.maximum is None  # the first's check
    other = Setting("n", "tiles", detail="square")
    assert registry.shared_setting([(A, same), (B, other)]).help == "A: count; even; B: tiles; square"
