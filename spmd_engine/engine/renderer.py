"""`llm_engine.renderer`: vLLM's step from user prompts to engine inputs, for clients that call it.

torchtitan's generator renders its prompts with `renderer.render_cmpl(prompts)` and hands
the results to `add_request`. Here a rendered prompt is vLLM's token prompt dict, the
token ids checked against the model and the text kept, which `add_request` takes as is.
"""

from __future__ import annotations

from typing import Sequence


class Renderer:
    def __init__(self, inputs):
        self.inputs = inputs

    @property
    def tokenizer(self):
        return self.inputs.tokenizer

    def render_cmpl(self, prompts: Sequence, tok_params=None, *, prompt_extras: dict | None = None,
                    skip_mm_cache: bool = False) -> list[dict]:
        """Each prompt (text, token ids, {"prompt"}, {"prompt_token_ids"}) as {"prompt_token_ids",
        "prompt"}; `tok_params` (vLLM's TokenizeParams) must be None: cut prompts with
        add_request's tokenization_kwargs instead."""
        if tok_params is not None or prompt_extras:
            raise NotImplementedError("renderer.render_cmpl: tok_params and prompt_extras are not supported "
                                      "by spmd_engine; pass tokenization_kwargs to add_request")
        rendered = []
        for index, prompt in enumerate(prompts):
            text, ids = self.inputs.encode(prompt, index)
            rendered.append({"prompt_token_ids": ids} if text is None else {"prompt_token_ids": ids, "prompt": text})
        return rendered

    def clear_mm_cache(self) -> None:
        """No multimodal cache here."""
