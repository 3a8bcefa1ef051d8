"""The vision budget per step and the priority rules around it (engine/core/vision_budget.py), on the
scheduler with fake sequences. What a step encodes is counted as the worker would (RequestState's
images_needed and the images it holds between steps: worker/step_images.py), not from the scheduler's
own count, so the bound is checked against what the vision tower would run."""
import torch

from helpers import full_attention_cache

from vlm_sdk.config import SchedulerConfig
from vlm_sdk.engine.core.scheduler import Scheduler
from vlm_sdk.engine.core.sequence import Sequence
from vlm_sdk.engine.core.vision_budget import MAX_VISION_WAITS, VisionBudget
from vlm_sdk.multimodal.inputs import ImageInput, PromptInputs
from vlm_sdk.sampling_params import SamplingParams

IMAGE = 1  # the image placeholder id in these fake prompts


def _image_seq(name: str, image_tokens: list[int], text: int = 4, max_tokens: int = 4) -> Sequence:
    """`text` tokens, then each image's tokens, then `text` tokens."""
    ids, positions, images = [0] * text, [], []
    for t in image_tokens:
        positions.append(len(ids))
        ids += [IMAGE] * t
        images.append(ImageInput(data=torch.zeros(1), num_tokens=t, key=f"{name}/{len(images)}".encode()))
    ids += [0] * text
    return Sequence(name, PromptInputs(token_ids=ids, images=images, image_positions=positions),
                    SamplingParams(max_tokens=max_tokens))


def _text_seq(name: str, n: int = 6, max_tokens: int = 4) -> Sequence:
    return Sequence(name, PromptInputs(token_ids=[0] * n), SamplingParams(max_tokens=max_tokens))


class WorkerView:
    """What the ranks hold between steps, as worker/step_images.py keeps it: per request, the images its
    chunks reached whose last token prefill has not passed; a request the worker does not hold (new or
    preempted) holds none. `step` returns the image tokens the step sends through the vision tower."""

    def __init__(self):
        self.held: dict[str, set[int]] = {}

    def step(self, out) -> int:
        for seq in out.preempted:
            self.held.pop(seq.request_id, None)
        encoded = 0
        for seq, n in out.scheduled:
            held = self.held.setdefault(seq.request_id, set())
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            for i, (pos, im) in enumerate(zip(seq.prompt.image_positions, seq.prompt.images)):
                if pos + im.num_tokens > start and pos < end and i not in held:  # images_needed, not held
                    encoded += im.num_tokens
                    held.add(i)
            held -= {i for i in held if seq.prompt.image_positions[i] + seq.prompt.images[i].num_tokens <= end}
        return encoded


def _scheduler(limit, max_num_seqs=16, tokens=4096, blocks=4000):
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=tokens, max_model_len=4000,
                                     max_model_len_source="test", max_num_encoder_tokens_per_step=limit),
                     full_attention_cache(blocks, 4))


def _run(sched: Scheduler, view: WorkerView, on_step=None, steps=500) -> list[int]:
    """Engine steps until nothing is left: computed tokens catch up, a sampled sequence grows by one and
    finishes at its max_tokens. The encoder tokens of every step."""
    encoded = []
    for k in range(steps):
        if on_step is not None:
            on_step(k)
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        sched.worker_input(out)
        encoded.append(view.step(out))
        if sched.config.max_num_encoder_tokens_per_step is not None:
            assert out.encoder_tokens == encoded[-1]  # the scheduler's count is the worker's
        for seq, n in out.scheduled:
            seq.num_computed_tokens += n
            if seq.num_computed_tokens == seq.num_tokens:
                seq.token_ids.append(7)
                if seq.num_output_tokens >= seq.params.max_tokens:
                    sched.finish(seq, "length")
    return encoded


def test_a_step_never_encodes_more_than_the_budget():
    sched, view = _scheduler(300), WorkerView()
    # a flood of images of several sizes and a long video of 12 frame groups, all at once
    for i in range(10):
        sched.add(_image_seq(f"im{i}", [64 * (1 + i % 4)]))
    sched.add(_image_seq("video", [100] * 12))
    sched.add(_image_seq("two", [200, 250]))
    encoded = _run(sched, view)
    assert not sched.has_unfinished()
    assert max(encoded) <= 300
    assert sum(encoded) == sum(64 * (1 + i % 4) for i in range(10)) + 1200 + 450  # every image exactly once
    unbounded = _scheduler(None)
    for i in range(10):
        unbounded.add(_image_seq(f"im{i}", [64 * (1 + i % 4)]))
    unbounded.add(_image_seq("video", [100] * 12))
    assert max(_run(unbounded, WorkerView())) > 300  # the same flood in one step without the budget


def test_a_large_video_spans_steps_a_frame_group_or_more_each():
    sched, view = _scheduler(250), WorkerView()
    video = _image_seq("video", [100] * 8, text=4)
    sched.add(video)
    chunks = []
    while video.num_output_tokens == 0:
        out = sched.schedule()
        sched.worker_input(out)
        chunks.append((out.scheduled[0][1], view.step(out)))
        for seq, n in out.scheduled:
            seq.num_computed_tokens += n
            if seq.num_computed_tokens == seq.num_tokens:
                seq.token_ids.append(7)
    # 2 groups a step (3 would be 300 > 250): each chunk ends just before the group that does not fit
    assert chunks == [(204, 200), (200, 200), (200, 200), (204, 200)]


def test_a_chunk_inside_a_held_image_costs_nothing_and_a_restart_pays_again():
    seq = _image_seq("a", [100, 100], text=4)  # images at 4..104 and 104..204
    budget = VisionBudget(150)
    assert budget.cut(seq, 0, 50) == 50 and budget.spent == 100  # reaches image 0
    seq.in_worker = True
    budget = VisionBudget(150)
    assert budget.cut(seq, 50, 100) == 100 and budget.spent == 100  # image 0 held; image 1 new at 104
    budget = VisionBudget(150)
    budget.spent = 100
    assert budget.cut(seq, 50, 100) == 54 and not budget.refused  # image 1 does not fit: the chunk ends at 104
    seq.in_worker = False  # preempted and restarted from a prefix hit inside image 0: the worker encodes it again
    budget = VisionBudget(150)
    budget.spent = 100
    assert budget.cut(seq, 50, 10) == 0 and budget.refused
    lone = VisionBudget(50)  # an image over the whole budget runs alone in a step
    assert lone.cut(seq, 0, 204) == 104 and lone.spent == 100


def test_text_admitted_during_a_flood_gets_its_first_token_in_the_next_step():
    """Steps, not seconds: a text request arriving while 40 images wait is admitted at once (images that do
    not fit the step's vision budget are passed over), and every running decode row is in every step."""
    sched, view = _scheduler(256, max_num_seqs=64), WorkerView()
    chat = _text_seq("chat0", max_tokens=30)
    sched.add(chat)
    for i in range(40):
        sched.add(_image_seq(f"im{i}", [256], max_tokens=2))
    first_token_steps = {}
    arrivals = {}

    def on_step(k):
        if k % 3 == 0 and k < 60:  # a new text user every third step
            seq = _text_seq(f"t{k}")
            arrivals[seq.request_id] = (k, seq)
            sched.add(seq)
        for name, (at, seq) in arrivals.items():
            if name not in first_token_steps and seq.num_output_tokens:
                first_token_steps[name] = k - at

    decoding_missed = []
    original = sched.schedule

    def schedule():
        decoding = [s for s in sched.running if s.num_output_tokens and not s.is_finished]
        out = original()
        got = {s.request_id for s, _ in out.scheduled}
        decoding_missed.extend(s.request_id for s in decoding if s.request_id not in got)
        return out
    sched.schedule = schedule
    encoded = _run(sched, view, on_step)
    assert max(encoded) <= 256
    assert len(first_token_steps) == len(arrivals)
    assert max(first_token_steps.values()) == 1  # admitted in the step after it arrived, its token from that step
    assert decoding_missed == []
    assert chat.num_output_tokens == 30


def test_a_prefill_chunk_leaves_each_decode_row_its_token():
    sched = _scheduler(None, tokens=16)
    decoders = [_text_seq(f"d{i}", n=2, max_tokens=50) for i in range(6)]
    for d in decoders:
        sched.add(d)
    _run(sched, WorkerView(), steps=2)  # the six are decoding now
    long = _text_seq("long", n=100)
    sched.running.insert(0, long)  # a prefill ahead of them in the running order (it started first)
    long.status = decoders[0].status
    assert sched.cache.allocate(long, 0)
    out = sched.schedule()
    assert [(s.request_id, n) for s, n in out.scheduled] == [("long", 10)] + [(d.request_id, 1) for d in decoders]


def test_an_image_passed_over_ages_and_then_goes_first():
    """A running video whose frame groups take the whole vision budget step after step: an image request
    behind it (its text before the image admitted at once) is passed over MAX_VISION_WAITS steps in a row,
    then its image's tokens are kept from the video's groups for one step; text requests go past it
    throughout."""
    sched, view = _scheduler(100), WorkerView()
    video = _image_seq("video", [100] * 60)
    sched.add(video)
    _run(sched, view, steps=1)
    image = _image_seq("image", [100])
    sched.add(image)
    texts, video_groups, image_done_at = [], [], None
    for k in range(MAX_VISION_WAITS + 5):
        t = _text_seq(f"t{k}")
        texts.append(t)
        sched.add(t)
        out = sched.schedule()
        sched.worker_input(out)
        assert view.step(out) <= 100
        chunks = dict((s.request_id, n) for s, n in out.scheduled)
        video_groups.append(chunks.get("video", 0) // 100)
        for seq, n in out.scheduled:
            seq.num_computed_tokens += n
            if seq.num_computed_tokens == seq.num_tokens:
                seq.token_ids.append(7)
                if seq.num_output_tokens >= seq.params.max_tokens:
                    sched.finish(seq, "length")
        if image_done_at is None and image.num_computed_tokens > 4:
            image_done_at = k
    # step 0 takes its 4 text tokens; steps 1..16 pass it over; step 17 encodes it
    assert image_done_at == MAX_VISION_WAITS + 1
    assert image.vision_waits == 0
    assert video_groups.count(0) == 1 and video_groups[MAX_VISION_WAITS + 1] == 0  # the video lost one step
    assert all(t.num_computed_tokens for t in texts)  # no text waited behind either


def test_max_prefill_tokens_with_decodes_cuts_prefill_chunks_beside_decode_rows():
    """Beside decode rows a prefill chunk computes at most max_prefill_tokens_with_decodes tokens a step, an
    image's tokens included (the image is encoded once, in the step that first reaches it), the decode rows
    their token each; without decode rows a prefill is not cut."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=4096, max_model_len=4000,
                                      max_model_len_source="test", max_num_encoder_tokens_per_step=256,
                                      max_prefill_tokens_with_decodes=64), full_attention_cache(400, 4))
    chat = _text_seq("chat", max_tokens=20)
    sched.add(chat)
    image = _image_seq("image", [200], max_tokens=1)
    view = WorkerView()
    chunks, encoded = [], []

    def on_step(k):
        if k == 2:
            sched.add(image)
    for k in range(12):
        on_step(k)
        out = sched.schedule()
        sched.worker_input(out)
        encoded.append(view.step(out))
        chunks.append(dict((s.request_id, n) for s, n in out.scheduled))
        for seq, n in out.scheduled:
            seq.num_computed_tokens += n
            if seq.num_computed_tokens == seq.num_tokens:
                seq.token_ids.append(7)
    assert [c.get("image") for c in chunks[2:6]] == [64, 64, 64, 16]  # 208 prompt tokens in 64s
    assert encoded[2] == 200 and sum(encoded) == 200  # the tower once, in its first step
    assert all(c["chat"] == 1 for c in chunks[1:])
    assert chunks[0] == {"chat": 6}
    alone = Scheduler(sched.config, full_attention_cache(400, 4))
    alone.add(_image_seq("alone", [200]))
    assert [n for _, n in alone.schedule().scheduled] == [208]  # no decode row: the whole prompt
