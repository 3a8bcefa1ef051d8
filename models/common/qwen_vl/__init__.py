"""What the Qwen-VL families share (Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE, and the Qwen3.5 families built on
the Qwen3-VL tower): the prompt processor, M-RoPE positions, image and video preprocessing, the vision
towers' parts, the model bases and the specs' settings and planner hooks; their test fixtures' shared parts.
A family folder imports these, never another family's folder (tests/structure/test_family_folders.py).

    spec.py                   QwenVLSpec (28-pixel cells), Qwen3VLTowerSpec (32): settings, planner hooks
    image_processor.py        Qwen2-VL's smart_resize / patchify (QwenImage, max_image_grid, pixels_to_device)
    qwen3_image_processor.py  the same at the Qwen3-VL tower's patch 16, checked against the vision config
    processor.py              QwenVLProcessor: messages -> PromptInputs (images, videos, M-RoPE positions)
    qwen3_processor.py        Qwen3VLProcessor: videos with a timestamp before each temporal patch
    rope_index.py             M-RoPE positions (transformers' get_rope_index)
    fixes.py, video_fixes.py  the settings that make a too-long prompt fit
    video_sampling.py         qwen-vl-utils' frame sampling; video_processor.py: a video -> temporal patches
    vision_attention.py       the towers' patch-grid check and block attention
    qwen3_vision.py           the Qwen3-VL vision tower (learned positions, DeepStack mergers)
    model.py                  QwenVLM: M-RoPE positions, the published checkpoint layout
    deepstack_model.py        DeepStackVLM: the Qwen3-VL architecture (Qwen3-VL's model, its MoE variant's base)
    fixtures.py, reference.py, qwen3_tiny_checkpoint.py, qwen3_chat_templates.py: tests and benchmarks only
"""
