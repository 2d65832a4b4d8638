"""``rollq gateway``: flags and the handler (served by ``ops.invocation.serve_http``)."""

from __future__ import annotations

import argparse
from collections.abc import Mapping

from ops.invocation import serve_http, settings_for

HELP = ("serve the capturing OpenAI-compatible gateway in front of vLLM servers: each "
        "episode gets its own base URL (POST /episodes), every call's tokens are recorded "
        "(POST /episodes/<id>/close returns them)")


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
        chat_template=args.chat_template)
    return await serve_http(create_app(settings), settings.host, settings.port,
                            metrics_port=settings.metrics_port)
