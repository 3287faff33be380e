"""Speculative decoding: propose tokens cheaply, verify them in one target forward pass.

:mod:`pagedkv.config.speculative` parses ``--speculative-config``; :mod:`.ngram` proposes by
prompt lookup; :mod:`.policy` decides how many tokens each sequence proposes and whether a step
verifies; :mod:`.rejection` verifies proposals against the target's logits (the only module here that
needs torch: import it directly); :mod:`.metrics` counts what was drafted and accepted.
"""

from pagedkv.engine.spec.metrics import SpecDecodingStats
from pagedkv.engine.spec.ngram import NgramProposer
from pagedkv.engine.spec.policy import AcceptanceEstimate, SpecPolicy, StepCostModel

__all__ = [
    "AcceptanceEstimate",
    "NgramProposer",
    "SpecDecodingStats",
    "SpecPolicy",
    "StepCostModel",
]
