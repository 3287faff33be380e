"""Logits to decisions: sampler, token constraints, beams, prompt logprobs."""
