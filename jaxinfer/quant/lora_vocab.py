"""VocabLora: the embedding together with the LoRA adapters of the embedding and of the LM head.

    rows   = embed[token]  + scale_i * A_i[:, token] @ B_i     (embed_tokens: PEFT's lora_embedding_A/B)
    logits = h @ head      + scale_i * (h @ A_i) @ B_i          (lm_head)

for a token (a logits row) of adapter slot i (slot 0: none). It takes the place of the family's
`embed` leaf when the LoRA slots hold either module (worker/lora_state.py): the embedding and
the LM head are the two ends of the vocabulary, and a tied LM head reads the same leaf, so one
wrapper serves tied and untied models alike and no family's parameter tree changes. Either pair
of stacks is None when the slots do not hold that module.

    embed_a [S, V, R]   a token's row of its slot's A (PEFT's lora_embedding_A transposed)
    embed_b [S, R, E]   the scale folded in
    head_a  [S, E, R]
    head_b  [S, R, V]   the scale folded in

`vocab_rows` (the families' embedding lookup) and `head_logits` (their LM head) pass a plain
embedding through. Two masks are bound in the step (quant/lora_bind.py's `bind`, `bind_head`): `mask` [T, S], the batch
tokens' slots, for the embedding; `head_mask` [N, S], the slots of the rows the LM head scores
(each sequence's last token, a verify step's drafts, or every row for prompt logprobs). Each
share runs over every slot at once, masked (the same shapes whichever adapters a batch mixes),
and is always computed where a mask is bound, as quant/lora.py's `with_lora`'s. Gemma scales
the embedding's rows by sqrt(hidden) after the lookup, the adapter's share with them, as PEFT does.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxinfer.quant.lora import WrapsWeight
from jaxinfer.quant.weights import embedding_rows

Weight = Any  # the embedding as the family holds it: an array or a QuantizedWeight
STACKS = ("embed_a", "embed_b", "head_a", "head_b")


@dataclasses.dataclass(frozen=True)
class VocabLora(WrapsWeight):
    base: Weight  # [V, E]
    embed_a: Any = None  # [S, V, R]
    embed_b: Any = None  # [S, R, E]
    head_a: Any = None  # [S, E, R]
    head_b: Any = None  # [S, R, V]
    mask: jax.Array | None = None  # [T, S] the tokens' slots, one-hot
    head_mask: jax.Array | None = None  # [N, S] the LM head rows' slots, one-hot

    @property
    def num_slots(self) -> int:
        return (self.embed_a if self.embed_a is not None else self.head_a).shape[0]

    def stacks(self) -> list[tuple[str, Any, Any]]:
        """(module, A, B) of each pair of stacks held: "embed_tokens", "lm_head"."""
        pairs = [("embed_tokens", self.embed_a, self.embed_b), ("lm_head", self.head_a, self.head_b)]
        return [(m, a, b) for m, a, b in pairs if a is not None]


def vocab_name(stack: str) -> str:
    """The leaf name of one of the stacks ("embed.lora_embed_a", ...)."""
    return f"embed.lora_{stack}"


jax.tree_util.register_pytree_with_keys(
    VocabLora,
    lambda w: (
        [
            (jax.tree_util.FlattenedIndexKey(0), w.base),
            *((jax.tree_util.GetAttrKey(vocab_name(n)), getattr(w, n)) for n in STACKS),
            (jax.tree_util.GetAttrKey("lora_mask"), w.mask),
            (jax.tree_util.GetAttrKey("lora_head_mask"), w.head_mask),
        ],
        None,
    ),
    lambda _, children: VocabLora(*children),
    lambda w: ((w.base, w.embed_a, w.embed_b, w.head_a, w.head_b, w.mask, w.head_mask), None),
)


def vocab_axes() -> dict[str, tuple[str, ...]]:
    """Logical axes of the stacks: the vocabulary splits like the embedding's (sharding/rules.py)."""
    return {
        vocab_name("embed_a"): ("lora_slots", "vocab", "lora_rank"),
        vocab_name("embed_b"): ("lora_slots", "lora_rank", "embed"),
        vocab_name("head_a"): ("lora_slots", "embed", "lora_rank"),
        vocab_name("head_b"): ("lora_slots", "lora_rank", "vocab"),
    }


def unwrapped(embed: Any) -> Weight:
    """The family's embedding leaf without its adapters (what the LM head's base product reads)."""
    return embed.base if isinstance(embed, VocabLora) else embed


def vocab_rows(embed: Any, tokens: jax.Array) -> jax.Array:
    """The embedding's rows [T, E] of `tokens` i32[T] (quant.embedding_rows) plus, where the leaf
    is a VocabLora, each token's embedding adapter share."""
    rows = embedding_rows(unwrapped(embed), tokens)
    if not isinstance(embed, VocabLora):
        return rows
    w, mask = embed, embed.mask
    if w.embed_a is None or mask is None:
        return rows

    def share() -> jax.Array:
        picked = jnp.take(w.embed_a, tokens, axis=1).astype(rows.dtype)  # [S, T, R]: each token's A column
        picked = picked * mask.T.astype(rows.dtype)[..., None]  # only each token's own slot
        return jnp.einsum("str,sre->te", picked, w.embed_b.astype(rows.dtype))

    return rows + share().astype(rows.dtype)


def head_logits(embed: Any, hidden: jax.Array, logits: jax.Array) -> jax.Array:
    """logits [N, V] (the base LM head's of hidden [N, E]) plus, where the embedding leaf is a
    VocabLora, the LM head adapters' share."""
    if not isinstance(embed, VocabLora):
        return logits
    w, mask = embed, embed.head_mask
    if w.head_a is None or mask is None:
        return logits

    def share() -> jax.Array:
        xa = jnp.einsum("ne,ser->nsr", hidden, w.head_a.astype(hidden.dtype))
        xa = xa * mask.astype(hidden.dtype)[..., None]
        return jnp.einsum("nsr,srv->nv", xa, w.head_b.astype(hidden.dtype))

    return logits + share().astype(logits.dtype)
