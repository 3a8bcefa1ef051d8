"""The start-up capacity line counts images as the plan does: requests at once of max_model_len tokens, and
of one image at the largest allowed size plus the default max_tokens (memory/startup.at_once_shapes,
memory/capacity.requests_at_once), worked out by hand on the tiny Qwen2.5-VL (its largest image: 256 tokens)."""
from vlm_sdk import LLM
from vlm_sdk.sampling_params import DEFAULT_MAX_TOKENS


def test_the_line_counts_an_image_at_the_largest_size(tiny_ckpt, caplog):
    with caplog.at_level("INFO", logger="vlm_sdk"):
        llm = LLM(tiny_ckpt, num_blocks=512, block_size=4, max_num_seqs=8, show_progress=False)
    report = llm.memory_report
    image = report.image_tokens_per_image
    assert image == 256 and report.max_model_len == 2048  # 512 blocks x 4 tokens
    # 2048 tokens = 512 blocks: 1 at once; 256 + 256 = 512 tokens = 128 blocks: 4 at once (< max_num_seqs 8)
    assert report.at_once == ((2048, 0, 0, 1), (image + DEFAULT_MAX_TOKENS, 1, image, 4))
    line = ("1 request of 2,048 tokens (max_model_len); 4 requests of 512 tokens, each with 1 image at the largest "
            "allowed size (256 tokens each) + 256 text and output")
    assert line in report.format() and line in caplog.text  # what start-up logs
    llm.shutdown()
    small = LLM(tiny_ckpt, num_blocks=4096, block_size=4, max_num_seqs=8, show_progress=False)
    assert small.memory_report.at_once[1][3] == 8  # 4096 // 128 = 32 > max_num_seqs: that binds
    small.shutdown()
