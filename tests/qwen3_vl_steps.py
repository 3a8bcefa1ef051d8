"""Steps of a Qwen3-VL model (dense or MoE) on a paged KV cache built by hand, and the same prompt through
transformers: the prompts, pixels and step plumbing the Qwen3-VL family tests share; one tensor-parallel
rank's prefill of an image prompt (`tp_prefill`)."""
from __future__ import annotations

import torch

from helpers import image
from vlm_sdk.attention.metadata import AttentionMetadata, StepMetadata
from vlm_sdk.config import EngineArgs
from vlm_sdk.layers.parallel_state import ParallelGroups, TPGroup
from vlm_sdk.model_loader import iter_safetensors, load_tokenizer, read_checkpoint
from vlm_sdk.models.base import StepImages
from vlm_sdk.models.registry import resolve
from vlm_sdk.models.common.qwen_vl.image_processor import QwenImage
from vlm_sdk.models.common.qwen_vl.rope_index import mrope_positions
from vlm_sdk.multimodal.inputs import ImageInput

BLOCK = 16
NUM_BLOCKS = 16
GRID_A, GRID_B = (1, 8, 12), (1, 16, 6)  # 24 and 24 image tokens, 4x6 and 8x3 merged: different shapes


def prompt(cfg, name: str) -> tuple[list[int], list[tuple[int, int, int]]]:
    img, vs, ve = cfg.image_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id

    def image(grid):
        t, h, w = grid
        return [vs] + [img] * (t * h * w // 4) + [ve]
    if name == "text":
        return [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43], []
    if name == "one_image":
        return [7, 8] + image(GRID_A) + [10, 11, 12, 13], [GRID_A]
    if name == "two_images":
        return [7] + image(GRID_A) + [20, 21] + image(GRID_B) + [30, 31, 32], [GRID_A, GRID_B]
    if name == "image_at_start":
        return image(GRID_B)[1:] + [40, 41, 42, 43], [GRID_B]
    raise KeyError(name)


def pixels(grids, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(sum(t * h * w for t, h, w in grids), 3 * 2 * 16 * 16, generator=g)


class Seq:
    """One prompt prepared for our model: token embeddings, the image rows (as the runner hands them
    over), M-RoPE positions, the transformers inputs."""

    def __init__(self, model, ids: list[int], grids, seed: int = 0):
        self.ids, self.grids, self.img = ids, grids, model.image_token_id
        self.pixel_values = pixels(grids, seed) if grids else None
        self.positions, self.delta = mrope_positions(ids, grids, model.image_token_id, model.spatial_merge_size)
        ids_t = torch.tensor(ids)
        self.image_rows = (ids_t == model.image_token_id).nonzero().flatten()  # [n]
        with torch.no_grad():
            self.embeds = model.embed_tokens(ids_t)  # [L, hidden]
            self.image_embeds = None
            if grids:
                parts = self.pixel_values.split([t * h * w for t, h, w in grids])
                images = [ImageInput(p, t * h * w // 4, QwenImage(g)) for p, g in zip(parts, grids) for t, h, w in [g]]
                self.image_embeds = model.encode_images(images)  # [n, hidden * (1 + levels)]

    def chunk(self, start: int, end: int):
        """(embeds, positions, StepImages | None) of tokens start..end."""
        keep = (self.image_rows >= start) & (self.image_rows < end)
        images = None
        if bool(keep.any()):
            images = StepImages(self.image_rows[keep] - start, self.image_embeds[keep])
        return self.embeds[start:end].clone(), self.positions[:, start:end], images

    def hf_kwargs(self) -> dict:
        input_ids = torch.tensor([self.ids])
        kw = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids))
        if self.grids:
            kw.update(pixel_values=self.pixel_values, image_grid_thw=torch.tensor(self.grids),
                      mm_token_type_ids=(input_ids == self.img).int())
        return kw


def new_cache(model) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (NUM_BLOCKS, BLOCK, model.num_kv_heads, model.head_dim)
    return [(torch.zeros(shape), torch.zeros(shape)) for _ in range(model.num_layers)]


def run_step(model, kv, items):
    """items: ((embeds [q, hidden], positions [3, q], StepImages | None), block ids, seq_len after this
    step) per sequence. Returns the logits of every new token, split per sequence."""
    slots, tables, rows, embeds = [], [], [], []
    q_lens = [part[0].shape[0] for part, _, _ in items]
    seq_lens = [s for _, _, s in items]
    width = max(len(b) for _, b, _ in items)
    offset = 0
    for ((_, _, images), blocks, seq_len), q in zip(items, q_lens):
        p = torch.arange(seq_len - q, seq_len)
        slots.append(torch.tensor(blocks)[p // BLOCK] * BLOCK + p % BLOCK)
        tables.append(blocks + [0] * (width - len(blocks)))
        if images is not None:
            rows.append(images.rows + offset)
            embeds.append(images.embeds)
        offset += q
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots),
        query_start_loc=torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        query_lens_cpu=q_lens, seq_lens_cpu=seq_lens, max_query_len=max(q_lens), max_seq_len=max(seq_lens))
    meta = StepMetadata.uniform(model.decoder.ops.attention.prepare(meta, kv[0][0]), len(kv))  # once per step, as the runner does
    images = StepImages(torch.cat(rows), torch.cat(embeds)) if rows else None
    with torch.no_grad():
        hidden = model(torch.cat([part[0] for part, _, _ in items]),
                       torch.cat([part[1] for part, _, _ in items], dim=1), kv, meta, images)
        logits = model.compute_logits(hidden)
    return list(logits.split(q_lens))


def decode_item(model, seq: Seq, token: int, index: int, blocks):
    """The 1-token step for the token at sequence index `index`: position index + rope_delta on all axes."""
    with torch.no_grad():
        e = model.embed_tokens(torch.tensor([token]))
    return (e, torch.full((3, 1), index + seq.delta, dtype=torch.int64), None), blocks, index + 1


def hf_generate(hf, seq: Seq, steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy tokens and the logits of each generated step (step 0 = last prompt position)."""
    with torch.no_grad():
        out = hf.generate(**seq.hf_kwargs(), max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                          output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(seq.ids):].tolist(), [step[0] for step in out.logits]


def blocks_for(n: int) -> list[int]:
    return list(range(-(-n // BLOCK)))


def check_decode_matches_generate(hf, model, name: str, close, steps: int = 4) -> None:
    """Prefill prompt `name`, then decode transformers' greedy tokens one step at a time: each step's
    logits `close` to `generate`'s and its argmax the token generate chose."""
    seq = Seq(model, *prompt(hf.config, name))
    n = len(seq.ids)
    tokens, ref_logits = hf_generate(hf, seq, steps=steps)
    blocks = blocks_for(n + steps)
    kv = new_cache(model)
    (logits,) = run_step(model, kv, [(seq.chunk(0, n), blocks, n)])
    assert int(logits[-1].argmax()) == tokens[0]
    close(logits[-1], ref_logits[0])
    for step in range(1, steps):
        (logits,) = run_step(model, kv, [decode_item(model, seq, tokens[step - 1], n + step - 1, blocks)])
        assert int(logits[0].argmax()) == tokens[step]
        close(logits[0], ref_logits[step])


def check_chunked_prefill(hf, model, split: int, close) -> None:
    """The two-image prompt prefilled in two chunks split at token `split` (scattered blocks): the second
    chunk's logits `close` to one whole prefill's."""
    seq = Seq(model, *prompt(hf.config, "two_images"))
    n = len(seq.ids)
    blocks = [5, 2, 7, 0, 9]
    (full,) = run_step(model, new_cache(model), [(seq.chunk(0, n), blocks, n)])
    kv = new_cache(model)
    run_step(model, kv, [(seq.chunk(0, split), blocks, split)])
    (rest,) = run_step(model, kv, [(seq.chunk(split, n), blocks, n)])
    close(rest, full[split:])


def image_prompt(ckpt):
    """An image prompt built by the checkpoint's family's processor."""
    info = read_checkpoint(ckpt)
    fam = resolve([info.architecture])
    ip = fam.image_processor_cls.from_preprocessor_config(info.preprocessor, info.hf_config)
    conv = [{"role": "user", "content": [{"type": "image", "image": image(160, 96, 4)},
                                         {"type": "text", "text": "What is in this image?"}]}]
    return fam.make_processor(load_tokenizer(ckpt), ip, info.hf_config, EngineArgs())(conv)


@torch.no_grad()
def tp_prefill(ckpt, tp: TPGroup, shard_vision: bool, expert_parallel: bool = False) -> dict:
    """One rank's prefill of `image_prompt` (weights read lazily: only its slices): the logits, its KV and
    vision heads, the image rows."""
    info = read_checkpoint(ckpt)
    parallel = ParallelGroups(tp, expert_parallel=expert_parallel)
    model = resolve([info.architecture]).model_cls(info.hf_config, parallel=parallel, shard_vision=shard_vision)
    model.load_weights(iter_safetensors(ckpt, show_progress=False, lazy=tp.size > 1), source=ckpt)
    prompt = image_prompt(ckpt)
    n = len(prompt.token_ids)
    rows = torch.cat([torch.arange(p, p + im.num_tokens) for p, im in zip(prompt.image_positions, prompt.images)])
    images = StepImages(rows, model.encode_images(prompt.images))  # [n, hidden * 3]
    blocks = -(-n // BLOCK)
    shape = (blocks, BLOCK, model.num_kv_heads, model.head_dim)  # this rank's KV heads
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(model.num_layers)]
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n), query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32), block_tables=torch.arange(blocks, dtype=torch.int32)[None],
        query_lens_cpu=[n], seq_lens_cpu=[n], max_query_len=n, max_seq_len=n)
    meta = StepMetadata.uniform(model.decoder.ops.attention.prepare(meta, caches[0][0]), len(caches))
    hidden = model(model.embed_tokens(torch.tensor(prompt.token_ids)), model.positions(prompt.positions, 0, n),
                   caches, meta, images)
    return {"logits": model.compute_logits(hidden), "num_kv_heads": model.num_kv_heads,
            "vision_heads": model.visual.blocks[0].heads, "images": images.embeds}
