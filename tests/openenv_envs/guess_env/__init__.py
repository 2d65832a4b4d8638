"""A number-guessing OpenEnv env, written as OpenEnv's docs and ``openenv init`` template
write one: ``models.py`` (the action and observation), ``server/guess_environment.py`` (an
``Environment`` subclass) and ``server/app.py`` (``create_app``)."""
