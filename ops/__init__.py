"""Ops: CLI, settings, logging, status and tail, the local stack. The composition root."""
