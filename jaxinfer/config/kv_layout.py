"""How a model's layers share the paged KV cache: groups by attention kind (plain Python).

A layer either reads every earlier token (full attention) or the last W tokens (a sliding window
of W). Layers that read alike form groups; each group has its own page table per sequence, so a
sliding-window group can give back the pages that fell out of its window while a full-attention
group keeps them all (the KV cache manager's groups, jaxinfer/kv/groups.py).

    one kind of layer     one group of every layer, one cache per layer (the plain layout)
    kinds mixed           each kind's layers, in order, split into groups of C layers (C: the
                          fewest layers of any kind; a kind whose count is no multiple of C has
                          its last group short), full attention first; C caches, and layer j of
                          each group reads and writes cache j through its group's page table

So a page id names the same slot of the C caches, one group holds it at a time, and a page costs
C layers' bytes whichever group holds it: every group draws from one pool, and a sequence's
sliding-window groups hold only their window's pages. Gemma 3 270M (18 layers, every sixth
global): C = 3, one full-attention group and five sliding ones. (vLLM's hybrid KV cache manager
lays hybrid models out the same way.)
"""

from __future__ import annotations

import dataclasses
import functools

from jaxinfer.config.model import ModelConfig


@dataclasses.dataclass(frozen=True)
class KVLayout:
    windows: tuple[int | None, ...]  # each group's sliding window; None: full attention
    groups: tuple[tuple[int, ...], ...]  # each group's layers; the j-th of a group uses cache j
    num_caches: int

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @functools.cached_property
    def _slots(self) -> dict[int, tuple[int, int]]:
        return {layer: (g, j) for g, layers in enumerate(self.groups) for j, layer in enumerate(layers)}

    def slot(self, layer: int) -> tuple[int, int]:
        """(group, cache) of `layer`: its page table and the cache it reads and writes."""
        return self._slots[layer]

    @property
    def layer_caches(self) -> tuple[int, ...]:
        """The cache of each layer, in layer order."""
        return tuple(self.slot(i)[1] for i in range(len(self._slots)))


@functools.cache
def kv_layout(config: ModelConfig) -> KVLayout:
    """The groups of `config`'s layers (module docstring); one per config, computed once (each
    layer of a traced forward asks for it)."""
    layers = range(config.num_layers)
    windows = [config.layer_window(i) for i in layers]
    kinds = sorted(set(windows), key=lambda w: -1 if w is None else w)  # full attention first
    if len(kinds) == 1:
        return KVLayout((kinds[0],), (tuple(layers),), config.num_layers)
    by_kind = {w: [i for i in layers if windows[i] == w] for w in kinds}
    size = min(len(members) for members in by_kind.values())
    group_windows, groups = [], []
    for w in kinds:
        members = by_kind[w]
        for start in range(0, len(members), size):
            group_windows.append(w)
            groups.append(tuple(members[start : start + size]))
    return KVLayout(tuple(group_windows), tuple(groups), size)
