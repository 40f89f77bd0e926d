"""``belayer generate``: one request through the router, streamed to the terminal."""

from __future__ import annotations

import sys
import uuid
from collections.abc import Callable
from typing import Any

import msgspec
import typer

from belayer.api import AsyncNode
from common.config import RunPaths
from common.node import read_node
from schemas.serving import MAX_TOKENS, GenerateRequest, SamplingParams, TokenDelta
from services.cli.shared import checked, fail, finite, print_json, run, with_bus

# `belayer generate`'s options (declared here, so that `generate` reads as what it does)
GENERATE_PROMPT = typer.Option(..., "--prompt", "-p", help="Prompt text.")
GENERATE_MAX_TOKENS = typer.Option(
    64, "--max-tokens", min=1, max=MAX_TOKENS, help="Most new tokens."
)
GENERATE_TEMPERATURE = typer.Option(
    1.0, "--temperature", min=0.0, max=100.0, callback=finite, help="0 = greedy."
)
GENERATE_TOP_P = typer.Option(1.0, "--top-p", callback=finite, help="Nucleus sampling mass (0, 1].")
GENERATE_SEED = typer.Option(
    None,
    "--seed",
    min=-(2**63),
    max=2**63 - 1,
    help="Seed: the same seed reproduces the same tokens, even across a handover.",
)
GENERATE_REQUEST_ID = typer.Option(
    "",
    "--request-id",
    help="Caller-chosen id (default: random); resubmitting an id never generates twice.",
)
GENERATE_ENGINE = typer.Option(None, "--engine", help="Pin to an engine id.")
GENERATE_IGNORE_EOS = typer.Option(False, "--ignore-eos", help="Keep generating past EOS.")
GENERATE_JSON = typer.Option(False, "--json", help="Print the result as JSON.")
GENERATE_TIMEOUT = typer.Option(
    300.0,
    "--timeout",
    min=0.001,
    max=86_400.0,
    callback=finite,
    help="Overall deadline in seconds. Until then a router restart or a dropped stream is "
    "ridden through: the same request id is resubmitted and the stream re-attached.",
)
GENERATE_NATS_URL = typer.Option("", "--nats-url", help="NATS URL (default: the running node's).")


def generate(
    prompt: str = GENERATE_PROMPT,
    max_tokens: int = GENERATE_MAX_TOKENS,
    temperature: float = GENERATE_TEMPERATURE,
    top_p: float = GENERATE_TOP_P,
    seed: int | None = GENERATE_SEED,
    request_id: str = GENERATE_REQUEST_ID,
    engine: str | None = GENERATE_ENGINE,
    ignore_eos: bool = GENERATE_IGNORE_EOS,
    json_out: bool = GENERATE_JSON,
    timeout: float = GENERATE_TIMEOUT,
    nats_url: str = GENERATE_NATS_URL,
) -> None:
    """Generate text from a prompt on the running node."""
    if not 0.0 < top_p <= 1.0:
        fail("--top-p must be in (0, 1]", 2)
    req = GenerateRequest(
        request_id=request_id or f"cli-{uuid.uuid4().hex[:12]}",
        prompt=prompt,
        sampling=SamplingParams(
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            max_tokens=max_tokens,
            ignore_eos=ignore_eos,
        ),
        stream=not json_out,
        engine_id=engine,
    )
    checked(req)  # the router's own validation, before anything is sent

    decode = _local_decoder()
    state: dict[str, Any] = {"tokens": [], "shown": ""}

    def on_delta(d: TokenDelta) -> None:
        # Stream text as it is produced: decode everything so far and print what is new
        # (byte-level tokens may only form a character once the next token arrives).
        state["tokens"] += d.token_ids
        if decode is None:
            sys.stdout.write(".")
        else:
            # Hold back a trailing partial character (U+FFFD) until its bytes are complete.
            text = decode(state["tokens"]).rstrip("\ufffd")
            if text.startswith(state["shown"]):
                sys.stdout.write(text[len(state["shown"]) :])
                state["shown"] = text
        sys.stdout.flush()

    async def go(nc: Any) -> Any:
        return await AsyncNode.over(nc).generate_request(
            req, timeout=timeout, on_delta=None if json_out else on_delta
        )

    result = run(with_bus(nats_url or None, go))
    if json_out:
        print_json(msgspec.to_builtins(result))
        return
    if decode is None or result.text != state["shown"]:
        sys.stdout.write("\n" + result.text)
    sys.stdout.write("\n")
    typer.echo(
        f"[{result.request_id}: {len(result.token_ids)} tokens, finish={result.finish_reason}, "
        f"weights v{result.weight_version}, engines {','.join(result.engine_ids)}, resumes {result.resumes}, "
        f"router restarts {result.router_restarts}]"
    )


def _local_decoder() -> Callable[[list[int]], str] | None:
    """The running node's tokenizer (from its node file), to stream text; None if unavailable."""
    node = read_node(RunPaths.default())
    if node is None or not node.model_dir:
        return None
    try:
        from model.tokenizer import load_tokenizer

        return load_tokenizer(node.model_dir).text
    except (OSError, ValueError):
        return None
