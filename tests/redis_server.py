"""The tests' real redis-server: the same embedded process ``rollq demo`` uses."""

from rollq.ops.local.stack import RedisProcess as RedisServer
from rollq.ops.local.stack import free_port

__all__ = ["RedisServer", "free_port"]
