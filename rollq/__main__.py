"""``python -m rollq``: the ``rollq`` program."""

from rollq.ops.cli import run

run()
