"""Consumers of the rollout streams: the scorer and the trainer SDK."""
