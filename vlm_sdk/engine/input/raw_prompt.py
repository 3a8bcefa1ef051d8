"""A prompt without a chat template (`TextPrompt`, `TokensPrompt`) as the token ids the family's
processor turns into `PromptInputs` (`PromptProcessor.text_prompt`: its positions, no images).

    TextPrompt:   length-checked and tokenized like any prompt text (PromptTokenizer: a text that
                  cannot fit is refused before it is tokenized whole), special tokens added as the
                  tokenizer adds them (add_special_tokens, vLLM's default for completions); special-
                  token text is the special token, since no template puts a turn around it
    TokensPrompt: every id inside the vocabulary (else a 400 naming it), which is what keeps a bad
                  id from reaching the embedding table
"""
from __future__ import annotations

from vlm_sdk.engine.input.prompt_tokenizer import PromptTokenizer
from vlm_sdk.engine.input.special_text import ESC
from vlm_sdk.errors import InvalidRequestError
from vlm_sdk.multimodal.prompts import RawPrompt, TextPrompt


class RawPromptTokens:
    """`vocab_size`: the model's embedding rows; ids must also be the tokenizer's, so that every
    prompt token can be shown as text (echo, logprobs)."""

    def __init__(self, tokenizer: PromptTokenizer, vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = min(vocab_size, len(tokenizer.wrapped))

    def __call__(self, prompt: RawPrompt) -> list[int]:
        if isinstance(prompt, TextPrompt):
            ids = self._encode(prompt.text)
            if not ids:
                raise InvalidRequestError("the prompt text has no tokens; give some text to complete", param="prompt")
            return ids
        ids = list(prompt.token_ids)
        bad = [(i, t) for i, t in enumerate(ids) if not 0 <= t < self.vocab_size]
        if bad:
            shown = ", ".join(f"{t} (position {i})" for i, t in bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5
                                                                            else "")
            raise InvalidRequestError(f"the prompt holds {len(bad)} token id(s) outside the vocabulary: {shown}; this "
                                      f"model's token ids are 0 to {self.vocab_size - 1}", param="prompt")
        return ids

    def _encode(self, text: str) -> list[int]:
        """Tokenized with special-token text read as special tokens; an escape character the user typed
        stays itself (PromptTokenizer reads escapes, see engine/input/special_text.py)."""
        self.tokenizer.check_length(len(text))
        if self.tokenizer.special_text is not None and ESC in text:
            text = text.replace(ESC, ESC + ESC)
        return self.tokenizer.encode(text, add_special_tokens=True)
