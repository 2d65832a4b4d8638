"""A trainer started on a run no other role has worked on: a typo in its name, or a new run.

``RunCheck.at_start`` says so at once (``run_not_found_at_start``, WARNING, the known runs)
unless the settings say the trainer starts a new run (``new_run``). Until some other role
works on the run (``schemas.runs.run_started``: a feeder recorded its settings, a group
was published or scored), ``publish_policy`` sends nothing to the servers
(``policy_not_published``): they may serve the run the user meant, and a typo must not
replace that run's policy with this trainer's step-0 weights.
"""

from __future__ import annotations

import redis.asyncio as aioredis
import structlog

from rollq.schemas.runs import known_runs, run_started, unknown_run_message

log = structlog.get_logger("rollq.trainer")


class RunCheck:
    """Whether this trainer's run has started; one per ``TrainerClient``."""

    def __init__(self, redis: aioredis.Redis, run: str, *, new_run: bool) -> None:
        self.redis = redis
        self.run = run
        self.new_run = new_run
        self.unconfirmed = False
        """The run had not started when the client did, and has not since (as last read)."""

    async def at_start(self) -> None:
        """Read the run's state as the client starts; warn when it has not started."""
        self.unconfirmed = not self.new_run and not await run_started(self.redis, self.run)
        if self.unconfirmed:
            known = await known_runs(self.redis)
            log.warning("run_not_found_at_start", run=self.run, role="trainer",
                        known_runs=[name for name in known if name != self.run],
                        message=unknown_run_message(self.run, "trainer", known)
                        + "; it sends no weights to its inference servers until another "
                        "role works on the run (new_run=True, or the example trainer's "
                        "--new-run, when it starts a new run)")

    async def may_publish(self, step: int, servers: int) -> bool:
        """Whether weights of ``step`` may go to the ``servers``; when not, one WARNING (the
        run's version in force stays)."""
        if self.unconfirmed:
            self.unconfirmed = not await run_started(self.redis, self.run)
        if not self.unconfirmed:
            return True
        log.warning("policy_not_published", run=self.run, step=step,
                    message=f"weights of step {step} not sent to the {servers} inference "
                    f"server(s): run {self.run!r} did not exist when this trainer started "
                    "and no other role has worked on it yet; pass new_run=True (--new-run) "
                    "when this trainer starts a new run")
        return False
