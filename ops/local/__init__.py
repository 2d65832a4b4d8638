"""The laptop stack: the demos, their warm starts and evaluations, the tiny model, a local
Redis, vLLM and Redis Cluster. The only place ``ops`` imports torch, transformers or
matplotlib."""
