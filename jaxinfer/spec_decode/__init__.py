"""Speculative decoding: proposers draft tokens on the host, the step verifies them in-jit.

    proposer.py    Proposer: the interface the engine calls (propose / release / warm_up)
    ngram.py       NgramProposer: prompt lookup over the sequence's own tokens (numpy)
    draft.py       DraftModelProposer: a second model with its own worker and KV pages
    speculator.py  Speculator: proposals into the plan, verified tokens out of the step

Configured by EngineConfig.speculative_config (jaxinfer/config/speculative.py); the host bookkeeping is
jaxinfer/core/spec.py and the in-jit verification jaxinfer/sampling/rejection.py.
"""

from jaxinfer.spec_decode.draft import DraftModelProposer
from jaxinfer.spec_decode.ngram import NgramProposer, ngram_lookup
from jaxinfer.spec_decode.proposer import Proposer
from jaxinfer.spec_decode.speculator import Speculator, build_speculator

__all__ = ["DraftModelProposer", "NgramProposer", "Proposer", "Speculator", "build_speculator", "ngram_lookup"]
