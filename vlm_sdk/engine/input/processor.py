"""A request's way into the engine, on the caller's thread (`LLM`) or a prep pool's (`AsyncLLM`, whose
engine replicas serve `ReplicaSetLLM`): `InputProcessor` holds the prompt tokenizer, the prompt guard,
the chat setup (tools, reasoning, chat_template_kwargs), the grammar compiler and the family's prompt
processor, and turns a request into a checked `PromptInputs`:

    check_params   sampling settings against the vocabulary and the engine's limits
    build_prompt   messages (or a text / token ids) -> PromptInputs: guard, family processor, tokenizer,
                   the fit check, the chat options' output format and grammar
    check_prompt   InputTooLongError when the prompt can never fit (the fixes fit the whole request)
    compile_grammar  the request's compiled grammar (waited for on the grammar workers)

`LLMEngine` makes one before any rank starts and gives it the cache's capacity once that is sized
(`set_capacity`); it then only schedules, runs and post-processes (engine/llm_engine.py). The
tokenizer is behind a lock, so every method may run on any thread; none touches the scheduler.
"""
from __future__ import annotations

import threading
import time

from vlm_sdk.chat_options import NO_OPTIONS, ChatOptions, ToolLimits
from vlm_sdk.config import EngineArgs
from vlm_sdk.engine.input.chat_setup import ChatSetup
from vlm_sdk.engine.input.prompt_guard import PromptGuard
from vlm_sdk.engine.input.prompt_tokenizer import PromptTokenizer, PromptTooLong
from vlm_sdk.engine.input.raw_prompt import RawPromptTokens
from vlm_sdk.engine.input.sampling_check import check_sampling
from vlm_sdk.engine.structured_output import Grammar, GrammarCompiler
from vlm_sdk.errors import InvalidRequestError
from vlm_sdk.memory.capacity import check_prompt_fits, text_too_long
from vlm_sdk.model_loader import load_tokenizer
from vlm_sdk.multimodal.inputs import PromptInputs
from vlm_sdk.multimodal.pixel_workers import PixelWorkers
from vlm_sdk.multimodal.prompts import TextPrompt, TokensPrompt
from vlm_sdk.multimodal.video_io import VideoLimits
from vlm_sdk.sampling_params import SamplingParams


class InputProcessor:
    def __init__(self, model_dir: str, info, family, args: EngineArgs):
        """`info`: the checkpoint (model_loader.read_checkpoint), `family`: its FamilySpec. The family's
        processor is made first (it checks `args.mm_processor_kwargs`): a refused setting starts no
        grammar worker."""
        self.args = args
        self.tokenizer = PromptTokenizer(load_tokenizer(model_dir), not args.allow_special_tokens_in_text)
        self.image_processor = family.image_processor_cls.from_preprocessor_config(info.preprocessor, info.hf_config)
        self.processor = family.make_processor(self.tokenizer, self.image_processor, info.hf_config, args)
        if args.preprocess_workers:  # started now: their imports overlap the engine's start
            self.processor.pixel_workers = PixelWorkers(args.preprocess_workers)
        self.guard = PromptGuard(self.tokenizer, args.max_image_pixels, args.max_request_image_pixels,
                                 VideoLimits(args.max_video_bytes, args.max_video_seconds, args.max_video_frames,
                                             args.max_video_decode_pixels, args.max_video_container_frames))
        self.eos_token_ids = set(info.eos_token_ids)
        self.vocab_size = vocab_size = int(family.text_config(info.hf_config).vocab_size)  # the logits' width
        self.raw_prompt_tokens = RawPromptTokens(self.tokenizer, vocab_size)
        self.grammars = GrammarCompiler(self.tokenizer.wrapped, vocab_size, sorted(self.eos_token_ids),
                                        cache_memory=args.grammar_cache_memory, max_bytes=args.max_grammar_bytes,
                                        max_memory=args.max_grammar_memory, timeout=args.grammar_compile_timeout,
                                        workers=args.grammar_workers)
        # tools, reasoning and chat_template_kwargs: how a chat's options reach its prompt and grammar
        self.chat = ChatSetup(self.tokenizer, self.grammars, args.tool_call_parser, args.reasoning_parser,
                              ToolLimits(args.max_tools, args.max_tool_bytes))
        self.cache_config = self.scheduler_config = self.max_position_embeddings = None  # set_capacity's

    def set_capacity(self, cache_config, scheduler_config, max_position_embeddings: int) -> None:
        """The sized cache (memory.kv.CacheConfig) and scheduler (config.SchedulerConfig): what a prompt
        is checked against from now on; one image's and one text's tokens are capped at max_model_len."""
        self.cache_config, self.scheduler_config = cache_config, scheduler_config
        self.max_position_embeddings = max_position_embeddings
        self.processor.max_image_tokens = scheduler_config.max_model_len
        self.tokenizer.max_tokens = scheduler_config.max_model_len

    def close(self) -> None:
        """End the grammar workers and their processes, and the image preprocessing processes. Idempotent."""
        self.grammars.close()
        if self.processor.pixel_workers is not None:
            self.processor.pixel_workers.close()

    def build_prompt(self, request, params: SamplingParams | None = None,
                     cancelled: threading.Event | None = None, options: ChatOptions | None = None,
                     compile_grammar: bool = True, check_fit: bool = True) -> PromptInputs:
        """`request` as chat messages: validate them, decode and preprocess images, render the chat
        template and tokenize; `options` (tools, chat_template_kwargs, cache_salt) set the prompt's
        output format and grammar (engine/input/chat_setup.py). As a `TextPrompt` or `TokensPrompt` (no
        template, no images, of the options only cache_salt; its output is read as plain text): tokenize the text, or
        check the ids against the vocabulary (engine/input/raw_prompt.py). Either way the family's
        processor makes the `PromptInputs`, and a prompt that can never fit raises (the fixes the error
        names fit the prompt and `params.max_tokens`). Once `cancelled` is set, the images not decoded
        yet raise `DecodeCancelled` instead (see `PromptGuard`). `params`' grammar is compiled first; the
        tools' schemas and the prompt's grammar (a forced call) only once the prompt is known to fit.
        `compile_grammar` False: the caller compiles the grammars (AsyncLLM awaits `params`' before, the
        tools' check and the prompt's after). `check_fit` False (the dry run, engine/render.py): a prompt
        longer than max_model_len is returned, not refused (a text refused before it was tokenized whole still
        raises `InputTooLongError`, and one image over max_model_len alone `InvalidImageError`, before resizing)."""
        t0 = time.perf_counter()
        params, options = params or SamplingParams(), options or NO_OPTIONS
        self.check_params(params)
        raw = isinstance(request, (TextPrompt, TokensPrompt))
        if raw and (options.tools or options.chat_template_kwargs):
            raise InvalidRequestError("tools and chat_template_kwargs apply to chat messages; a text or token-id "
                                      "prompt has no chat template", param="prompt")
        if compile_grammar:
            self.compile_grammar(params)  # a bad schema fails before any image is decoded
        template_kwargs = None if raw else self.chat.prepare(options, params)  # so do too many tools
        try:
            if raw:
                prompt = self.processor.text_prompt(self.raw_prompt_tokens(request))
            else:  # the tools' definitions count in the length guard: they are rendered into the prompt
                prompt = self.processor(self.guard.prepare(request, cancelled, self.chat.tool_chars(options)),
                                        template_kwargs)
        except PromptTooLong as e:  # a huge text: refused from its token count, before any conversion
            if not e.exact:
                raise text_too_long(e.num_tokens, self.cache_config, self.scheduler_config,
                                    self.args.max_model_len is not None) from None
            prompt = PromptInputs(token_ids=[0] * e.num_tokens)  # what check_prompt counts
            check_fit = True  # no token ids to return: the refusal is the answer
        if check_fit:
            self.check_prompt(prompt, params)
        if not raw:
            self.chat.finish(prompt, options, params, compile_grammar)
        elif options.cache_salt is not None:  # no images to salt: the block hashes only
            prompt.cache_salt = options.cache_salt
        prompt.preprocess_seconds = time.perf_counter() - t0
        return prompt

    def check_prompt(self, prompt: PromptInputs, params: SamplingParams | None = None) -> None:
        """`InputTooLongError` when the prompt can never fit; its fixes fit the whole request (the prompt
        and the max_tokens of `params`, default `SamplingParams()`'s)."""
        params = params or SamplingParams()
        check_prompt_fits(prompt, self.cache_config, self.scheduler_config, self.max_position_embeddings,
                          self.args.max_model_len is not None, self.processor.image_setting_fixes,
                          params.max_tokens, self.processor.video_setting_fixes)

    def check_params(self, params: SamplingParams | None) -> None:
        """`InvalidRequestError` when `params` names token ids outside the vocabulary or asks more of
        every step than the engine's limits allow (engine/input/sampling_check.py)."""
        if params is not None:
            check_sampling(params, self.vocab_size, self.eos_token_ids, self.args.max_logit_bias,
                           self.args.max_stop_token_ids)

    def compile_grammar(self, params: SamplingParams | None, prompt: PromptInputs | None = None) -> Grammar | None:
        """The compiled grammar of the request: the one `build_prompt` set on `prompt` (a forced tool
        call, or a structured output after reasoning), else `params`' structured output; None without
        one. Waited for: compiled on the grammar workers (engine/structured_output.py), cached, so the
        engine thread only copies its start state. Raises `InvalidRequestError` naming the field when it
        cannot be compiled."""
        spec = prompt.grammar if prompt is not None and prompt.grammar is not None else \
            params.grammar if params is not None else None
        return None if spec is None else self.grammars.compile(spec)
