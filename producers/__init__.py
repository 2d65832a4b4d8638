"""Producers: env definitions, the vLLM inference client, the arq worker pool and the feeder."""
