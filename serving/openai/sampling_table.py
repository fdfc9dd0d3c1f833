"""The HTTP API's request fields -> SamplingParams fields (serving.sampling_fields), for
/v1/completions and /v1/chat/completions.

inputs.py converts by this table: the fields taken as they are (`same_name()`) are copied by
name, and each of the others has its conversion in inputs.py, named here. Every SamplingParams
field is offered today (OpenAI's fields, then the top-level extras vLLM accepts), so nothing is
listed as not exposed.
"""

from __future__ import annotations

from serving.sampling_fields import AS_IS, FieldMapping, SamplingTable

SAMPLING_TABLE = SamplingTable(
    "HTTP request body",
    mapped=(
        *(
            FieldMapping((name,), name, AS_IS)
            for name in (
                "n",
                "temperature",
                "top_p",
                "seed",
                "presence_penalty",
                "frequency_penalty",  # OpenAI's
                "top_k",
                "min_p",
                "repetition_penalty",
                "ignore_eos",
                "skip_special_tokens",  # vLLM's extras
                "include_stop_str_in_output",
                "speculative",
                "prompt_logprobs",
            )
        ),
        FieldMapping(
            ("max_tokens", "max_completion_tokens"),
            "max_tokens",
            "completions: max_tokens, default 16 (echo with max_tokens 0 scores the prompt: 1, its token "
            "dropped); chat: max_completion_tokens, else max_tokens, default what the context leaves",
        ),
        FieldMapping(("stop",), "stop", "a string or a list of strings -> tuple"),
        FieldMapping(("stop_token_ids",), "stop_token_ids", "a list of token ids -> tuple; empty or null: none"),
        FieldMapping(
            ("logprobs", "top_logprobs"),
            "logprobs",
            "completions: logprobs (a count); chat: top_logprobs when logprobs is true (0 without it), "
            "None when logprobs is false",
        ),
        FieldMapping(("logit_bias",), "logit_bias", '{"token id": bias}: keys from strings to token ids'),
        FieldMapping(
            ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar"),
            "structured_output",
            "response_format json_object -> json_object, json_schema -> json (its `schema`); "
            "guided_json / guided_regex / guided_choice / guided_grammar -> json / regex / choice / grammar; "
            'at most one of them; a chat\'s tool_choice "required" or a named function sets it too',
        ),
    ),
)
