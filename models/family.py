"""What a model family folder provides: `FamilySpec` (one object, `FAMILY`, in `models/<family>/spec.py`)
and the small types its hooks speak in.

The engine, planner, server and CLI reach a family only through `vlm_sdk.models.registry`, and through
it only through this interface: the family's settings (a schema: name, type, default, help, checked
here), its classes (image processor, prompt processor, model) and its planner hooks: runtime hooks only.
Test and benchmark fixtures (tiny checkpoints, the transformers reference) are a family's `fixtures.py`
(`FamilyFixtures`, models/fixtures.py), registered in vlm_sdk/testing/families.py. Shared types carry the family's settings as opaque
mappings: `EngineArgs.mm_processor_kwargs` (engine-wide) and `ImageRef.options` (one image part).
"""
from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from vlm_sdk.errors import InvalidRequestError


@dataclass(frozen=True)
class Setting:
    """One family setting. Values are positive integers of at most `maximum` (MAX_SETTING_VALUE when
    None), positive finite numbers (of at most `maximum`) when `type` is float (a video's fps), or true /
    false when `type` is bool (a switch: the flags are `--name` / `--no-name`); `default` None means "the
    checkpoint's" (its preprocessor config). `detail` is the
    part of the help true of this family only (e.g. "a multiple of 28x28"): several families may
    declare one setting name, and its flag's help (`registry.engine_settings`) then gives each
    family's detail beside its name."""
    name: str
    help: str
    type: type = int
    default: Any = None
    maximum: int | None = None
    detail: str = ""

    @property
    def full_help(self) -> str:
        return f"{self.help}; {self.detail}" if self.detail else self.help

    def check(self, value: Any, where: str = "") -> Any:
        """`value` when valid; `InvalidRequestError` (param = the setting's name) otherwise. An integer
        too large for a float (JSON allows 10**400) is refused like any other out-of-range value."""
        if self.type is bool:
            if not isinstance(value, bool):
                raise InvalidRequestError(f"{where}{self.name} must be true or false, got {_shown(value)}",
                                          param=self.name)
            return value
        top = self.maximum if self.maximum is not None else MAX_SETTING_VALUE
        if self.type is float:
            number = _as_float(value)  # inf for an integer beyond a float's range
            if number is None or not number > 0:  # not a number, NaN, 0 or below
                raise InvalidRequestError(f"{where}{self.name} must be a positive number, got {_shown(value)}",
                                          param=self.name)
            if number == float("inf") or (self.maximum is not None and number > self.maximum):
                bound = f"of at most {self.maximum}" if self.maximum is not None else "below infinity"
                raise InvalidRequestError(f"{where}{self.name} must be a positive number {bound}, got "
                                          f"{_shown(value)}", param=self.name)
            return number
        if not isinstance(value, self.type) or isinstance(value, bool) or value < 1:
            raise InvalidRequestError(f"{where}{self.name} must be a positive integer, got {_shown(value)}",
                                      param=self.name)
        if value > top:
            raise InvalidRequestError(f"{where}{self.name} must be an integer from 1 to {top}, got {_shown(value)}",
                                      param=self.name)
        return value


# the largest values a video part may give (what is over the engine's video limits is refused there,
# naming them): frame counts and rates far beyond any video's, pixels far beyond any frame's
MAX_PART_FRAMES = 1_000_000
MAX_PART_FPS = 10_000
MAX_PART_PIXELS = 10 ** 12
# an integer setting without a maximum of its own: the largest integer a float holds exactly, so that
# arithmetic mixing it with floats (pixels / frames) never overflows
MAX_SETTING_VALUE = 2 ** 53


def _as_float(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        return float(value)
    except OverflowError:  # an int beyond a float's range
        return float("inf")


def _shown(value: Any) -> str:
    """`value` for an error message: a huge integer by its length, not its 400 digits."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10 ** 18:
        return f"an integer of {int(abs(value).bit_length() * 0.30103) + 1} digits"  # str() refuses > 4300
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


@dataclass(frozen=True)
class ImageSize:
    """An image size some settings allow: its image tokens, vision-tower rows (`ImageInput.size`
    units), in words; `value` is the planner setting value that makes it the largest (None: the
    value in effect)."""
    tokens: int
    patches: int
    text: str
    value: int | None


@dataclass(frozen=True)
class VideoTokens:
    """What one video part becomes in the prompt, from its container's size alone (the workload plan's
    count, `ImageLimits.video_for`): the frames sampled, the vision-tower items (a temporal patch or a
    frame: one encoder-cache entry each), the placeholder tokens the tower fills, and what the processor
    writes around each item beyond the one wrapper an image has: `texts` (a Qwen3-VL patch's timestamp,
    an InternVL frame's label), tokenized by the planner, and `special` tokens (per-item wrappers)."""
    frames: int
    items: int
    tokens: int
    texts: tuple[str, ...] = ()
    special: int = 0


@dataclass(frozen=True)
class ImageLimits:
    """The planner's view of a family's image sizing (`FamilySpec.image_limits`): one setting
    (`setting`, a plan option name such as "max_pixels" or "max_num") decides the largest image."""
    setting: str
    largest: ImageSize  # under the settings in effect
    at: Callable[[int], ImageSize]  # the largest image under setting value v
    candidates: Callable[[int], int | None]  # the largest value below the one in effect whose image fits
    # the tokens of an image of (width, height) pixels under the settings in effect: the workload plan's
    # count, from the size alone (plan/workload.py); None: the family gives none (each image counts as the largest)
    tokens_for: Callable[[int, int], int] | None = None
    # a video part of (width, height, frames in the container, its fps) under the settings in effect, a part's
    # own video options `options` applied: the processor's sampling and sizing (None: the family takes no video)
    video_for: Callable[[int, int, int, float, Mapping[str, Any]], VideoTokens] | None = None

    @property
    def tokens(self) -> int:
        return self.largest.tokens

    @property
    def patches(self) -> int:
        return self.largest.patches

    @property
    def text(self) -> str:
        return self.largest.text

    def fitting(self, limit: int) -> ImageSize | None:
        """The largest image of at most `limit` tokens: the allowed largest when it fits, else the one
        a smaller setting gives (its `value` names that setting); None when none fits."""
        if self.largest.tokens <= limit:
            return dataclasses.replace(self.largest, value=None)
        v = self.candidates(limit)
        return None if v is None else self.at(v)


class FamilySpec(ABC):
    """One model family. A subclass sets the class attributes and implements the hooks; its module
    (`models/<family>/spec.py`) defines `FAMILY = TheSpec()` and is named by one registry line.

    Class attributes:
        name              registry name, e.g. "qwen2_5_vl"
        display_name      in messages, e.g. "Qwen2.5-VL"
        engine_settings   `Setting`s of `EngineArgs.mm_processor_kwargs` (flags `--<name>`)
        image_settings    `Setting`s an image part may carry (`ImageRef.options`)
        video_settings    `Setting`s a video part may carry (`VideoRef.options`); none: the family
                          takes no video
        whole_images      the model's image tokens attend to each other during prefill (bidirectionally
                          within each image: Gemma 3), so the scheduler never ends a prefill chunk
                          inside an image and max_num_batched_tokens must hold one image's tokens
        plan_setting      (plan option, engine setting) the planner sizes images by, e.g.
                          ("max_dynamic_patch", "max_dynamic_patch"); the plan flag is `--<plan option>`.
                          One vocabulary: the plan option IS the engine setting's name, so a fix
                          `plan` prints pastes into `vlm-sdk serve` and `LLM(...)`
    """

    name: str
    display_name: str
    engine_settings: tuple[Setting, ...] = ()
    image_settings: tuple[Setting, ...] = ()
    video_settings: tuple[Setting, ...] = ()
    whole_images: bool = False
    plan_setting: tuple[str, str]

    # -- classes (imported when asked for: importing the spec imports no model code) -------------
    @property
    @abstractmethod
    def model_cls(self) -> type:
        """`VisionLanguageModel` subclass: `model_cls(hf_config, dtype=, device=, ops=,
        parallel=ParallelGroups(), shard_vision=True)` (`parallel`: this rank's groups, vlm_sdk/layers/
        parallel_state.py; `shard_vision` False replicates the vision tower and projector on every rank)."""

    @property
    @abstractmethod
    def image_processor_cls(self) -> type:
        """`.from_preprocessor_config(preprocessor_config.json as a dict, hf_config)`."""

    @property
    @abstractmethod
    def processor_cls(self) -> type:
        """`PromptProcessor` subclass: `.from_engine_args(tokenizer, image_processor, hf_config, EngineArgs,
        family)`."""

    def meta_model(self, hf_config: Any, dtype: Any, parallel: Any = None, shard_vision: bool = True) -> Any:
        """The model as rank 0 of the layout `parallel` (a `vlm_sdk.config.ParallelConfig`; None: one rank)
        builds it, on the meta device (no memory): what the engine and `vlm-sdk plan` read sizes and image
        limits from without loading anything."""
        import torch
        from vlm_sdk.config import ParallelConfig
        from vlm_sdk.layers.parallel_state import ParallelGroups
        with torch.device("meta"):
            return self.model_cls(hf_config, dtype=dtype, device="meta",
                                  parallel=ParallelGroups.first_rank(parallel or ParallelConfig()),
                                  shard_vision=shard_vision)

    def make_processor(self, tokenizer: Any, image_processor: Any, hf_config: Any, args: Any) -> Any:
        """The engine's prompt processor: this family's settings in `args.mm_processor_kwargs` checked,
        another family's refused."""
        return self.processor_cls.from_engine_args(tokenizer, image_processor, hf_config, args, self)

    def text_config(self, hf_config: Any) -> Any:
        """hf_config -> the language model's config (max_position_embeddings is read from it)."""
        from vlm_sdk.model_loader import text_config
        return text_config(hf_config)

    # -- settings ----------------------------------------------------------------------------------
    def engine_options(self, options: Mapping[str, Any]) -> dict[str, Any]:
        """`EngineArgs.mm_processor_kwargs` checked against `engine_settings`: another family's
        setting (or an unknown one) is refused naming the setting, this family and its settings."""
        return _checked(self, options, self.engine_settings, "engine setting", "")

    def image_options(self, options: Mapping[str, Any], where: str) -> dict[str, Any]:
        """One image part's `ImageRef.options` checked against `image_settings` (`where`: "image 0: ").
        A key that no registered family declares is ignored, as OpenAI and vLLM ignore unknown keys of
        an image part; another family's image setting is refused, since the size bound it asks for
        would not be applied here."""
        return _checked(self, options, self.image_settings, "image setting", where, ignore_unknown=True)

    def video_options(self, options: Mapping[str, Any], where: str) -> dict[str, Any]:
        """One video part's `VideoRef.options` checked against `video_settings` (`where`: "video 0: ")."""
        if not self.video_settings:
            raise InvalidRequestError(f"{where}{self.display_name} takes no video input; send images", param="messages")
        return _checked(self, options, self.video_settings, "video setting", where)

    # -- planner hooks -----------------------------------------------------------------------------
    @abstractmethod
    def image_limits(self, preprocessor: Mapping[str, Any], hf_config: Any, model: Any,
                     options: Mapping[str, Any]) -> ImageLimits:
        """The largest image the engine settings `options` allow (tokens, vision rows), the image a
        setting value `v` allows, and the search for the largest value whose image fits a limit.
        `model` is the engine's model built on the meta device."""

    @abstractmethod
    def vision_activation_widths(self, hf_config: Any, model: Any) -> tuple[int, int, int]:
        """(vision hidden size, vision MLP width, pixel values per vision row) for the vision tower's
        activation estimate (vlm_sdk/memory/consumers/activation.py)."""

    def video_item_tokens(self, preprocessor: Mapping[str, Any], hf_config: Any, model: Any) -> int:
        """Tokens of the largest vision item a video part becomes (a temporal patch of frames, or one
        frame), which the processor refuses to exceed; 0 (the default): the family takes no video.
        A prefilling request holds its chunk's items (vlm_sdk/worker/step_images.py), so the memory
        estimate counts a chunk of them plus one straddling each end (memory/consumers/activation.py)."""
        return 0


def _checked(family: FamilySpec, options: Mapping[str, Any], schema: tuple[Setting, ...], kind: str,
             where: str, ignore_unknown: bool = False) -> dict[str, Any]:
    by_name = {s.name: s for s in schema}
    out = {}
    for name, value in options.items():
        if value is None:
            continue
        if name not in by_name:
            if ignore_unknown and not _owners(name, family.name):
                continue
            accepted = ", ".join(by_name) or "none"
            raise InvalidRequestError(
                f"{where}{name}{'' if where else f'={value!r}'} is not {'an' if kind[0] in 'aeiou' else 'a'} {kind} of {family.display_name} (this "
                f"checkpoint's family, {family.name}){_owner(name, family.name)}; {family.display_name} "
                f"{kind}s: {accepted}", param=name)
        out[name] = by_name[name].check(value, where)
    return out


def _owners(name: str, this: str) -> list[str]:
    """The display names of the other registered families that declare a setting `name`."""
    from vlm_sdk.models.registry import families
    return [f.display_name for f in families() if f.name != this and
            name in {s.name for s in f.engine_settings + f.image_settings + f.video_settings}]


def _owner(name: str, this: str) -> str:
    owners = _owners(name, this)
    return f": it belongs to {' / '.join(owners)}" if owners else ""
