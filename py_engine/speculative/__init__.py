"""Speculative decoding that changes no output (ring 0, stdlib only): guess tokens ahead, verify them in one pass.

    from py_engine.speculative import Speculation, SpeculativeConfig
    config = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4})
    llm = LLM("smollm2-135m-instruct", speculative=config)    # or speculative="ngram" / a draft model's name

config (SpeculativeConfig, vLLM's field names) <- ngram (prompt lookup) and stats (counters, the acceptance
throttle) <- accept (Leviathan et al.'s rule for a sampled draft's q) <- session (one sequence: its proposer,
throttle and counts; a draft model as any single-sequence backend). py_engine.generate runs the loop; the server
(native_server) schedules drafts as extra tokens of a decode step. Exactness rests on the kernels computing a
token's logits the same way in a k + 1 row verify pass as in decode (the CPU kernels' one numeric path).
"""
from .config import METHODS, SpeculativeConfig, SpeculativeConfigError
from .ngram import NgramLookup
from .session import SequenceSpeculation, Speculation
from .stats import DraftLength, SpecStats, StepCosts

__all__ = ["METHODS", "NgramLookup", "SequenceSpeculation", "SpecStats", "Speculation", "SpeculativeConfig",
           "SpeculativeConfigError", "DraftLength", "StepCosts"]
