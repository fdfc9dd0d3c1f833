"""StepInputs: the compiled step's inputs, one pytree (its fields are described where the input
builder fills them: inputs.py).

    InputBuilder.prepare (inputs.py) -> StepInputs[np.ndarray] --placed on the devices-->
    StepInputs[jax.Array] -> the jitted step (step.py), where its arrays are tracers

The same tree also carries other leaves where a tree map puts them: the shardings the step takes
its inputs with (step_variants.input_shardings) are a StepInputs[NamedSharding].
"""

from __future__ import annotations

import flax.struct

from jaxinfer.models.layers import AttentionMetadata
from jaxinfer.sampling.arrays import SamplingArrays
from jaxinfer.sampling.prompt_logprobs import PromptInputs
from jaxinfer.sampling.rejection import SpecInputs
from jaxinfer.worker.page_table import PageTableUpdates


@flax.struct.dataclass(frozen=True)  # as flax makes it; said for the type checker: `A` is covariant
class StepInputs[A]:
    """`A`: the arrays' type, as in SamplingArrays (numpy from the builder, jax.Array placed)."""

    token_ids: A  # i32[T]
    positions: A  # i32[T]
    meta: AttentionMetadata[A]  # kv_lens [S], cu_q_lens [S+1], num_seqs [1]; page_indices: None (device: read)
    logits_indices: A  # i32[S] row of each sequence's last token in the batch ([S*(K+1)]: spec)
    sampling: SamplingArrays[A] | None  # one row per sequence slot; None: a split step's forward half
    prev_rows: A  # i32[T] row of the previous step's sampled tokens that is this token; -1: none
    page_slots: A  # i32[S] page-table row of each sequence (padding: the null row)
    spec: SpecInputs[A] | None = None  # draft tokens to verify (speculative decoding); None: none
    prompt: PromptInputs[A] | None = None  # prompt rows to score (prompt logprobs); None: none
    table: PageTableUpdates[A] | None = None  # page-table entries to set before the step; None: none
    lora_slots: A | None = None  # i32[T] each token's LoRA slot (0: none); None: LoRA is off

    def sampled(self) -> SamplingArrays[A]:
        """The sampling arrays of inputs that sample (all but a split step's forward half)."""
        if self.sampling is None:
            raise ValueError("these step inputs carry no sampling arrays (a split step's forward half)")
        return self.sampling
