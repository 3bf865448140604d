"""Turning logits into tokens: the sampler, its random draw, logit penalties."""
