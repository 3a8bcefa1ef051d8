"""Qwen3.5 checkpoints load strictly in both config layouts: the published config.json (the fields beside
`rope_parameters` that transformers 5 derives) gives the tokens of transformers 5's own; the
multi-token-prediction head (`mtp.*`, which every tiny checkpoint carries as the published ones do) is
skipped by name and counted, never read; any other tensor the model has no weight for is refused by name."""
from __future__ import annotations

import json
import logging
import shutil

import pytest
from safetensors.torch import load_file, save_file

from helpers import conversations
from vlm_sdk import LLM, SamplingParams
from vlm_sdk.errors import CheckpointError
from vlm_sdk.testing import make_tiny_checkpoint

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def test_the_published_layout_gives_the_tokens_of_transformers_5s_and_mtp_is_skipped(tiny_checkpoints,
                                                                                    tmp_path, caplog):
    nested = tiny_checkpoints("qwen3_5")
    published = make_tiny_checkpoint(tmp_path / "published", family="qwen3_5", config_layout="published")
    config = json.loads((published / "config.json").read_text())
    text = config["text_config"]
    assert text["full_attention_interval"] == 4 and text["attn_output_gate"] and text["mtp_num_hidden_layers"] == 1
    index = json.loads((published / "model.safetensors.index.json").read_text())["weight_map"]
    mtp = [k for k in index if k.startswith("mtp.")]
    assert mtp
    convs = [conversations()["one_image"], conversations()["text"]]
    with caplog.at_level(logging.INFO, logger="vlm_sdk"):
        ours = LLM(published, show_progress=False).chat(convs, GREEDY)
    assert f"skipped the checkpoint's {len(mtp)} multi-token-prediction tensors" in caplog.text
    assert [o.token_ids for o in ours] == [o.token_ids for o in LLM(nested, show_progress=False).chat(convs, GREEDY)]


def test_a_tensor_outside_the_model_and_the_mtp_head_is_refused_by_name(tiny_checkpoints, tmp_path):
    ckpt = tmp_path / "extra"
    shutil.copytree(tiny_checkpoints("qwen3_5"), ckpt)
    index_path = ckpt / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = ckpt / "model-mtp.safetensors"
    tensors = load_file(shard)
    name = "model.language_model.layers.0.linear_attn.extra_proj.weight"
    tensors[name] = next(iter(tensors.values())).clone()
    save_file(tensors, shard, metadata={"format": "pt"})
    index["weight_map"][name] = shard.name
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        LLM(ckpt, show_progress=False)
