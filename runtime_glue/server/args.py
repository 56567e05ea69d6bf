"""``ServerArgs``: the options of ``rlt-hal serve`` that are not the engine's, declared once.

``rlt-hal serve`` registers ``EngineArgs`` and ``ServerArgs``; a Serve config file's ``args``
hold the fields of both (``split_options``). Nothing here imports Ray.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

import attrs

from runtime_glue.engine.args import EngineArgs, add_fields, cli_field, from_fields
from runtime_glue.server import DEFAULT_JSON_WHITESPACE, DEFAULT_MAX_REQUEST_BYTES

RAY_OPTIONS = ("replicas", "ray_address", "ray_metrics_export_port", "cpus_per_replica")


@attrs.frozen(kw_only=True)
class ServerArgs:
    host: str = cli_field("127.0.0.1", "address to listen on")
    port: int = cli_field(8000, "port to listen on")
    served_model_name: str | None = cli_field(
        None,
        "the model name requests give (default: --model; without it rlt-hal-toy-trained for "
        "--preset trained, else rlt-hal-toy-random)",
    )
    api_key: str | None = cli_field(None, "require 'Authorization: Bearer KEY' on /v1/*")
    trust_request_chat_template: bool = cli_field(
        False,
        "use a chat_template a chat request gives (vLLM's flag; else such a request is a 400)",
        action="store_true",
    )
    enable_log_requests: bool = cli_field(
        False,
        "log each request on standard error as it is admitted: its id, the caller's user and "
        "metadata, prompt tokens, n, max_tokens and stream (vLLM's flag)",
        action="store_true",
    )
    default_max_tokens: int = cli_field(
        16,
        "a completions request's max_tokens when it gives none (16, as OpenAI's legacy "
        "completions API); a chat request without max_tokens runs to what is left of "
        "--max-model-len (and of the KV pool), as vLLM's",
    )
    max_request_bytes: int = cli_field(
        DEFAULT_MAX_REQUEST_BYTES,
        "request bodies larger than this are answered with 413 before they are read "
        f"(default {DEFAULT_MAX_REQUEST_BYTES})",
    )
    shutdown_timeout: float = cli_field(
        10.0, "seconds in-flight requests get to finish on SIGINT/SIGTERM"
    )
    json_whitespace: str = cli_field(
        DEFAULT_JSON_WHITESPACE,
        "the whitespace a structured JSON output may put between its tokens when the request "
        "does not say (a regex; '' for none, 'any' for unbounded)",
        metavar="REGEX",
    )
    # Replicas on Ray Serve (runtime_glue.server.replicas).
    replicas: int | None = cli_field(
        None,
        "serve N engines, one per device, behind one endpoint through Ray Serve",
        type=int,
        metavar="N",
    )
    ray_address: str | None = cli_field(
        None,
        "join this Ray cluster (auto: the one `ray start` began here); default: start one",
        metavar="auto|ADDR",
    )
    ray_metrics_export_port: int | None = cli_field(
        None,
        "where the Ray cluster this command starts serves every replica's metrics to "
        "Prometheus (a joined cluster: ray start --metrics-export-port)",
        type=int,
        metavar="PORT",
    )
    cpus_per_replica: float | None = cli_field(
        None,
        "CPU cores Ray reserves for each replica, its torch threads on --device cpu (default 1)",
        type=float,
    )

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        add_fields(parser, cls, [f.name for f in attrs.fields(cls) if f.name not in RAY_OPTIONS])
        add_fields(
            parser,
            cls,
            RAY_OPTIONS,
            group_title="replicas on Ray Serve (pip install 'rlt-hal[ray]'; see docs/scale-out.md)",
        )

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace | dict, **overrides: Any) -> ServerArgs:
        return from_fields(cls, args, **overrides)

    def model_name(self, engine: EngineArgs) -> str:
        if self.served_model_name or engine.model:
            return self.served_model_name or str(engine.model)
        return "rlt-hal-toy-trained" if engine.preset == "trained" else "rlt-hal-toy-random"

    def check_single(self) -> None:
        """Without ``--replicas``, the Ray options mean nothing: refuse them."""
        given = [
            "--" + name.replace("_", "-")
            for name in RAY_OPTIONS[1:]
            if getattr(self, name) is not None
        ]
        if given:
            raise ValueError(f"{', '.join(given)}: Ray options, for serve --replicas N only")


def split_options(options: Mapping[str, Any]) -> tuple[EngineArgs, ServerArgs]:
    """``rlt-hal serve`` options by field name (a Serve config file's ``args``), in the two
    values they build; a name neither declares is an error that says how to write one."""
    names = _names(EngineArgs) | _names(ServerArgs)
    unknown = sorted(set(options) - names)
    if unknown:
        raise ValueError(
            f"unknown rlt-hal serve option(s) {', '.join(unknown)}; "
            "see `rlt-hal serve --help` (write --max-num-seqs as max_num_seqs)"
        )
    return EngineArgs.from_cli_args(dict(options)), ServerArgs.from_cli_args(dict(options))


def _names(cls: type) -> set[str]:
    return {f.name for f in attrs.fields(cls)}


def as_options(*values: Any) -> dict[str, Any]:
    """The fields of attrs values as one options dict (the inverse of ``split_options``)."""
    out: dict[str, Any] = {}
    for value in values:
        out.update(attrs.asdict(value))
    return out
