"""What a family provides for tests and benchmarks only (`FamilyFixtures`): tiny and benchmark-sized
checkpoints with random weights, transformers as the oracle, its preprocessing against transformers'.

A family's `models/<family>/fixtures.py` defines `FIXTURES`, registered by one line in
vlm_sdk/testing/families.py. Runtime code never imports it (an import-linter contract holds it): a family's
`FamilySpec` (spec.py) carries runtime hooks only.
"""
from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Mapping


class FamilyFixtures(ABC):
    """Class attributes: `family` (the registry name), `bench_image_sizes` ((width, height) of the
    `vlm-sdk bench` workload's images, used in turn: sizes that exercise the family's own image sizing),
    `reference_module` (the transformers reference: `hf_model(model_dir, dtype)`,
    `hf_image_processor(model_dir, **kw)`, `hf_prompt(tokenizer, image_processor, config, messages)`),
    `preprocessing_module` (its `benchmark_against_transformers(images, ours=...)`)."""
    family: str
    bench_image_sizes: tuple[tuple[int, int], ...]
    reference_module: str
    preprocessing_module: str

    @property
    def reference(self) -> Any:
        return importlib.import_module(self.reference_module)

    @abstractmethod
    def make_tiny_checkpoint(self, path: Path, seed: int = 0, **overrides) -> Path:
        """A tiny random checkpoint of this family, saved by transformers (overrides: the builder's)."""

    @abstractmethod
    def make_bench_checkpoint(self, path: Path, seed: int = 0, **overrides) -> Path:
        """A ~100M-parameter random checkpoint for benchmarks."""

    def benchmark_preprocessing(self, preprocessor: Mapping[str, Any], hf_config: Any, images: list) -> dict:
        """This family's image preprocessing, configured by the checkpoint (preprocessor_config.json as a
        dict, hf_config), against transformers' on the same PIL `images`: at least `ours_ms_per_image`,
        `transformers_ms_per_image` and `max_abs_diff` (`models/common/reference.pixel_report`), on the
        family's own image processor class (a family reusing another's comparison keeps its own sizes)."""
        from vlm_sdk.models import registry
        ours = registry.load(self.family).image_processor_cls.from_preprocessor_config(dict(preprocessor), hf_config)
        return importlib.import_module(self.preprocessing_module).benchmark_against_transformers(images, ours=ours)
