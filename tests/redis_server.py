"""The tests' real redis-server: the same embedded process ``rollq demo`` uses."""

from ops.stack import RedisProcess as RedisServer
from ops.stack import free_port

__all__ = ["RedisServer", "free_port"]
