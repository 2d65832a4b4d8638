"""``python -m ops``: the ``rollq`` program."""

from rollq.ops.cli import run

run()
