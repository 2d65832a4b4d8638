"""``rollq atropos-env ENV ARGS…``: run an Atropos env as its authors do (``python ENV
serve ARGS…``), with three atroposlib 0.4.0 quirks fixed in the env's process.

atroposlib 0.4.0's ``ServerManager`` takes a server config that is not a list as a
*baseline*: it builds four servers at ``http://localhost:9004..9007/v1`` from it and
ignores its ``base_url``. An env whose ``config_init`` returns one ``APIServerConfig``
or a ``ServerBaseline`` (which ``--openai.*`` flags turn into one ``APIServerConfig``)
therefore never reaches the server its flags name: it waits for a healthy server
forever and logs nothing. (``config_init`` returning ``[config]``, as atroposlib's GSM8K
example does, is not affected.) Run through this module, such a config is handed to
``ServerManager`` as a list of one when its ``base_url`` is set (with ``api_key`` "x"
when none was given, as atroposlib's baseline servers get), and one line on stderr says
so; without a ``base_url`` it stays a baseline, and the line says which flag is
missing. Nothing else of the env changes.

Under transformers 5, ``apply_chat_template`` returns a ``BatchEncoding`` unless
``return_dict=False``; atroposlib 0.4.0's ``tokenize_for_trainer`` (and envs of its time)
expect the list of ids transformers 4 returned, and the env cannot post its group
(``Object of type BatchEncoding is not JSON serializable``). In this process a call that
tokenises without saying ``return_dict`` gets the list again (``fix_chat_template``).

atroposlib's env gives up on the API after 3 quick tries (``/status-env``, posts,
registration: ~1-4 s in all) and its process exits, so a restart of the API itself
(~2 s) could end it; ``rollq atropos-api`` holds requests through Redis outages, but
cannot answer while it restarts. Here those calls are retried with back-off for up to
``PATIENCE_S`` (``be_patient``); a post tried again is answered, not stored twice, by
the API's dedup window.

ENV is a file (``environments/gsm8k_server.py``: run as ``__main__``, as ``python
FILE`` would) or ``MODULE:CLASS`` (a ``BaseEnv`` subclass: its ``cli()``).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import runpy
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

USAGE = ("usage: rollq atropos-env ENV serve|process|evaluate [ARGS…]\n"
         "  ENV: an env file (environments/gsm8k_server.py) or MODULE:CLASS; ARGS as the "
         "env's own CLI takes them (--env.rollout_server_url, --openai.base_url, …)")
PREFIX = "rollq atropos-env:"
PATIENCE_S = 120.0
"""How long the env's calls to the API are retried (back-off up to 5 s) before it gives up."""
RETRIED = ("get_status", "_send_scored_data_to_api", "_register_env")
"""atroposlib's ``BaseEnv`` methods that call the API under a 3-try ``tenacity`` retry."""


def _say(line: str) -> None:
    print(f"{PREFIX} {line}", file=sys.stderr, flush=True)


def fix_single_server() -> None:
    """Make atroposlib's ``ServerManager`` use a lone server config's ``base_url``
    (module docstring). Idempotent."""
    handling = "atroposlib.envs.server_handling"
    manager: Any = importlib.import_module(f"{handling}.server_manager").ServerManager
    baseline = importlib.import_module(f"{handling}.server_baseline")
    api_server_config, server_baseline = baseline.APIServerConfig, baseline.ServerBaseline
    original = manager.__init__
    if getattr(original, "rollq_single_server", False):
        return

    @functools.wraps(original)
    def init(self: Any, configs: Any, *args: Any, **kwargs: Any) -> None:
        if isinstance(configs, api_server_config) and configs.base_url:
            _say(f"using {configs.base_url} as the env's inference server (atroposlib "
                 "0.4.0 would use localhost:9004-9007 for a config that is not a list)")
            # api_key "x" when none was given, as atroposlib's baseline servers get it
            configs = [configs.model_copy(update={"api_key": configs.api_key or "x"})]
        elif isinstance(configs, server_baseline) and not kwargs.get("testing"):
            _say("the env names no inference server: atroposlib uses "
                 "http://localhost:9004..9007/v1; pass --openai.base_url "
                 "http://API/inference/v1 (and --openai.server_type vllm)")
        original(self, configs, *args, **kwargs)

    init.rollq_single_server = True  # type: ignore[attr-defined]  # a marker on the function
    manager.__init__ = init  # the point of this module


def fix_chat_template() -> None:
    """Under transformers >= 5, make ``apply_chat_template`` return token ids, not a
    ``BatchEncoding``, when the caller tokenises without naming ``return_dict`` (what
    transformers 4 did; module docstring). Idempotent; nothing under transformers 4."""
    transformers: Any = importlib.import_module("transformers")
    if int(transformers.__version__.split(".")[0]) < 5:
        return
    base = transformers.PreTrainedTokenizerBase
    original = base.apply_chat_template
    if getattr(original, "rollq_ids_by_default", False):
        return

    signature = inspect.signature(original)

    @functools.wraps(original)
    def apply_chat_template(self: Any, *args: Any, **kwargs: Any) -> Any:
        given = signature.bind_partial(self, *args, **kwargs).arguments
        if given.get("tokenize", True) and "return_dict" not in given:
            kwargs["return_dict"] = False
        return original(self, *args, **kwargs)

    apply_chat_template.rollq_ids_by_default = True  # type: ignore[attr-defined]  # a marker
    base.apply_chat_template = apply_chat_template


def be_patient(patience_s: float = PATIENCE_S) -> None:
    """Retry the env's API calls (``RETRIED``) for up to ``patience_s`` instead of 3
    quick tries (module docstring). Idempotent."""
    tenacity: Any = importlib.import_module("tenacity")
    base: Any = importlib.import_module("atroposlib.envs.base").BaseEnv
    for name in RETRIED:
        method = getattr(base, name)
        if getattr(method, "rollq_patient", False):
            continue
        patient = method.retry_with(stop=tenacity.stop_after_delay(patience_s),
                                    wait=tenacity.wait_exponential(multiplier=0.25, max=5))
        patient.rollq_patient = True
        setattr(base, name, patient)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ENV's CLI with ARGS (``sys.argv[1:]`` when ``argv`` is None)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if args else 2
    target, rest = args[0], args[1:]
    is_file = target.endswith(".py") or Path(target).is_file()
    module, _, name = target.partition(":")
    if is_file and not Path(target).is_file():
        print(f"{PREFIX} no such env file: {target}", file=sys.stderr)
        return 2
    if not is_file and not name:
        print(f"{PREFIX} {target!r} is neither a .py file nor MODULE:CLASS\n{USAGE}",
              file=sys.stderr)
        return 2
    fix_single_server()
    fix_chat_template()
    be_patient()
    sys.argv = [target, *rest]
    if is_file:
        sys.path.insert(0, str(Path(target).resolve().parent))  # as `python FILE` does
        runpy.run_path(target, run_name="__main__")
    else:
        getattr(importlib.import_module(module), name).cli()
    return 0


if __name__ == "__main__":
    sys.exit(main())
