"""M-RoPE positions of a Qwen2.5-VL prompt, the same as HF `Qwen2_5_VLModel.get_rope_index`.

Every token gets three position ids (temporal, height, width):

    tokens:    t0 t1 <img x 6 (grid 1x4x6 patches, merge 2 -> 1x2x3)> t2 ...
    temporal:  0  1   2 2 2 2 2 2                                     5
    height:    0  1   2 2 2 3 3 3                                     5
    width:     0  1   2 3 4 2 3 4                                     5

Text tokens count up by one on all axes. An image block sits on a (t, h/merge, w/merge) grid offset by
the position where it starts; the text after any block resumes at the block's largest position + 1 on
every axis (for an image: start + max(h, w) / merge). Decode token at index p (p >= len(prompt)) has
position p + rope_delta on all three axes, rope_delta = the prompt's largest position + 1 - len(prompt):
the prompt's last position + 1 when text ends it.

A video is a run of temporal patches (2 frames each) on the same (h, w) grid, all starting at the run's
start position; patch k's temporal position is start + int(k * tokens_per_second * seconds per patch)
(float32, as transformers computes it). The processor hands each patch over as one `VisionSpan`
(t_offset = that temporal position minus start; `ends_run` on the last). Qwen3-VL writes each patch as a
run of its own between timestamp texts: every span ends its run, at temporal offset 0.

The text after a video whose time axis reaches past its spatial one (Qwen2.5-VL, a few seconds of video
at the default sampling) is where implementations part (issue 50 point 10). Qwen's own code resumes it
past the video's last temporal position: `st_idx = llm_pos_ids_list[-1].max() + 1` in its get_rope_index
(transformers PR #35569 by the Qwen team, transformers through 5.2, qwen-vl-finetune's rope2d.py, vLLM's
MRotaryEmbedding), and decoding continues after the prompt's largest position. transformers 5.3+
resumes the text at start + max(h, w) / merge, under the video's time axis, and its `generate` then
decodes from the last prompt position + 1 (transformers issue #45381 shows both rules on one video). We
follow Qwen's: the model was trained with it. Images, and Qwen3-VL's one-patch runs, place the same
under both.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MRopePositions:
    """`PromptInputs.positions` of a Qwen2.5-VL prompt: computed once by the processor, read by the
    model's `positions()`."""
    table: torch.Tensor  # [3, len(token_ids)] int64
    rope_delta: int  # decode token at index p has position p + rope_delta on all three axes

    def at(self, start: int, end: int) -> torch.Tensor:
        """Positions `[3, end - start]` of tokens start..end: the prompt's, then generated tokens'."""
        n_prompt = self.table.shape[1]
        parts = []
        if start < n_prompt:
            parts.append(self.table[:, start:min(end, n_prompt)])
        if end > n_prompt:
            parts.append((torch.arange(max(start, n_prompt), end) + self.rope_delta).expand(3, -1))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def prompt_positions_at(prompt_positions: MRopePositions | None, start: int, end: int) -> torch.Tensor:
    """A Qwen model's `positions()`: the prompt's M-RoPE table (then index + rope_delta for generated
    tokens), or the plain index on all three axes for a prompt built without the processor (text only)."""
    if prompt_positions is None:
        return torch.arange(start, end).expand(3, -1)
    return prompt_positions.at(start, end)


@dataclass(frozen=True)
class VisionSpan:
    """Vision tokens `start .. start + t*h*w` of a prompt, on a grid of t x h x w merged units."""
    start: int
    grid: tuple[int, int, int]  # (t, h, w) after merging
    t_offset: int = 0  # temporal position of the first row, relative to its run's start
    ends_run: bool = True  # False: the next span (the video's next patch) starts at the same position


def vision_positions(num_tokens: int, spans: list[VisionSpan]) -> tuple[torch.Tensor, int]:
    """Positions `[3, num_tokens]` int64 and rope_delta of a prompt whose vision tokens are `spans`
    (in order, not overlapping); every other token is text."""
    pieces: list[torch.Tensor] = []
    pos = 0  # the position the next text token or run takes
    run_top = 0  # the largest position of the run so far, relative to pos
    prev_end = 0
    for span in spans:
        t, gh, gw = span.grid
        if span.start > prev_end:
            pieces.append((torch.arange(span.start - prev_end, dtype=torch.int64) + pos).expand(3, -1))
            pos += span.start - prev_end
        grid = torch.stack(torch.meshgrid(torch.arange(t, dtype=torch.int64) + span.t_offset,
                                          torch.arange(gh, dtype=torch.int64),
                                          torch.arange(gw, dtype=torch.int64), indexing="ij"))  # [3, t, gh, gw]
        pieces.append(grid.reshape(3, -1) + pos)
        run_top = max(run_top, span.t_offset + t - 1, gh - 1, gw - 1)
        if span.ends_run:  # Qwen's rule: what follows a run starts past its largest position on every axis
            pos += run_top + 1
            run_top = 0
        prev_end = span.start + t * gh * gw
    if num_tokens > prev_end:
        pieces.append((torch.arange(num_tokens - prev_end, dtype=torch.int64) + pos).expand(3, -1))
    if not pieces:
        return torch.zeros(3, 0, dtype=torch.int64), 0
    positions = torch.cat(pieces, dim=1)  # [3, L]
    return positions, int(positions.max()) + 1 - num_tokens


def video_time_offsets(num_patches: int, sample_fps: float, temporal_patch_size: int,
                       tokens_per_second: float) -> list[int]:
    """Each temporal patch's temporal position relative to the video's start: int(k * interval), with
    interval = tokens_per_second * (temporal_patch_size / sample_fps) in float32, as transformers'
    processor hands `second_per_grid_ts` to `get_rope_index` (a float32 tensor)."""
    seconds = torch.tensor([temporal_patch_size / sample_fps])[0]  # float32, as the processor's BatchFeature
    interval = tokens_per_second * seconds
    return (torch.arange(num_patches) * interval).long().tolist()


def _image_runs(ids: torch.Tensor, image_token_id: int) -> list[tuple[int, int]]:
    """(start, end) of each maximal run of image tokens."""
    is_img = (ids == image_token_id).to(torch.int8)  # [L]
    edges = torch.diff(is_img, prepend=is_img.new_zeros(1), append=is_img.new_zeros(1))  # [L + 1]
    starts = (edges == 1).nonzero().flatten().tolist()
    ends = (edges == -1).nonzero().flatten().tolist()
    return list(zip(starts, ends))


def mrope_positions(token_ids: list[int],
                    image_grid_thw: list[tuple[int, int, int]],
                    image_token_id: int,
                    spatial_merge_size: int) -> tuple[torch.Tensor, int]:
    """Positions `[3, len(token_ids)]` int64 and `rope_delta` (max position + 1 - len(token_ids)).

    The i-th run of `image_token_id` is image i and must hold t*h*w/merge^2 tokens; raises `ValueError`
    when the runs and the grids disagree.
    """
    ids = torch.as_tensor(token_ids, dtype=torch.int64)
    num_tokens = ids.numel()
    runs = _image_runs(ids, image_token_id) if num_tokens else []
    if len(runs) != len(image_grid_thw):
        raise ValueError(f"prompt has {len(runs)} run(s) of image token {image_token_id} but "
                         f"{len(image_grid_thw)} image grid(s) were given; each image needs one contiguous "
                         f"run of t*h*w/{spatial_merge_size ** 2} image tokens")
    spans = []
    for i, ((start, end), (t, h, w)) in enumerate(zip(runs, image_grid_thw)):
        gh, gw = h // spatial_merge_size, w // spatial_merge_size
        expected = t * gh * gw
        if h % spatial_merge_size or w % spatial_merge_size or end - start != expected:
            raise ValueError(f"image {i} (grid t={t}, h={h}, w={w}, merge {spatial_merge_size}) needs {expected} "
                             f"image tokens but its run at token {start} has {end - start}")
        spans.append(VisionSpan(start, (t, gh, gw)))
    return vision_positions(num_tokens, spans)
