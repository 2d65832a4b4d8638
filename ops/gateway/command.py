"""``rollq gateway``: flags and the handler (served by ``ops.invocation.serve_http``)."""

from __future__ import annotations

import argparse
from collections.abc import Mapping

from ops.invocation import serve_http, settings_for

HELP = ("serve the capturing OpenAI-compatible gateway in front of vLLM servers: each "
        "episode gets its own base URL (POST /episodes), every call's tokens are recorded "
        "(POST /episodes/<id>/close returns them); with --sessions, agents outside rollq's "
        "workers open episodes (POST /sessions) kept in Redis")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", help="interface to listen on [127.0.0.1]")
    parser.add_argument("--port", type=int, help="port to listen on [8100]")
    parser.add_argument("--inference", nargs="+", metavar="URL",
                        help="vLLM base URL(s) [ROLLQ_INFERENCE, default http://127.0.0.1:8000]")
    parser.add_argument("--model", help="served model name [asked from /v1/models]")
    parser.add_argument("--episode-ttl", type=float, dest="episode_ttl_s",
                        help="drop an episode idle this many seconds [3600]")
    parser.add_argument("--tokenizer",
                        help="the model's tokenizer (directory or hub id): render chat "
                        "continuations in the gateway, checked against the server, instead of "
                        "asking /tokenize (needs transformers) [off]")
    parser.add_argument("--chat-template",
                        help="with --tokenizer: the template vLLM was started with (file) "
                        "[the tokenizer's own]")
    parser.add_argument("--sessions", action="store_true", default=None,
                        help="serve external agent sessions (POST /sessions) kept in the "
                        "run's Redis and published onto its traj stream when closed "
                        "(docs/guides/external-sessions.md) [off]")
    parser.add_argument("--session-ttl", type=float, dest="session_ttl_s",
                        help="with --sessions: dead-letter a session group idle this many "
                        "seconds [900]")
    parser.add_argument("--max-staleness", type=int,
                        help="with --sessions: admission, as `rollq feed` [1]")
    parser.add_argument("--batch-groups", type=int,
                        help="with --sessions: admission, as `rollq feed` [8]")
    parser.add_argument("--continuation-check", choices=["after", "before"],
                        help="check a chat continuation for re-tokenisation before sending it "
                        "(two /tokenize renders) or after (no extra request unless it "
                        "drifted: then the reply is discarded and resent token-in) [before]")


async def gateway(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    from ops.gateway.app import create_app
    from ops.gateway.settings import GatewaySettings

    inference = [url for value in args.inference or [] for url in value.split(",") if url]
    settings: GatewaySettings = settings_for(
        GatewaySettings, args, environ, host=args.host, port=args.port,
        inference=inference or None, model=args.model, episode_ttl_s=args.episode_ttl_s,
        continuation_check=args.continuation_check, tokenizer=args.tokenizer,
        chat_template=args.chat_template, sessions=args.sessions,
        session_ttl_s=args.session_ttl_s, max_staleness=args.max_staleness,
        batch_groups=args.batch_groups)
    return await serve_http(create_app(settings), settings.host, settings.port,
                            metrics_port=settings.metrics_port)
