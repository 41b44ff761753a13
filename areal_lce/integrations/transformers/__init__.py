"""Hugging Face transformers integration: a reversible, instance-level fused-LM-head patch.

    import areal_lce.integrations.transformers
    areal_lce.integrations.transformers.apply(model, temperature=1.0, backend="auto")
    out = model(input_ids, labels=labels)   # out.loss, out.logprobs, out.entropy, ...; out.logits is None
    areal_lce.integrations.transformers.remove(model)

See docs/hf.md.
"""
from .head import fused_head
from .patch import (
    LCECausalLMOutput,
    VERIFIED_MODEL_TYPES,
    apply,
    check_supported,
    is_patched,
    next_token_labels,
    remove,
)

__all__ = ["apply", "remove", "is_patched", "check_supported", "fused_head", "next_token_labels",
           "LCECausalLMOutput", "VERIFIED_MODEL_TYPES"]
