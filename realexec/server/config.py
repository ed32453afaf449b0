"""ServerConfig: what protects the HTTP server (auth, limits, timeouts, shutdown).

Each field is one `serve` flag (underscores become dashes), built by `add_server_args`
from the fields' help, as EngineArgs does for the engine's knobs.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from core.cli_args import add_dataclass_args, dataclass_from_args, knob

API_KEY_ENV = "TWINSERVE_API_KEY"
MiB = 1 << 20


def _arg(default, help: str, type=None):
    return knob(default, help, type=type)


@dataclass
class ServerConfig:
    api_key: str | None = _arg(
        None, f"require 'Authorization: Bearer KEY' on every route but /health (and /metrics unless "
              f"--protect-metrics); 401 otherwise. Default: ${API_KEY_ENV} if set (preferred: a flag "
              f"shows in the process list), else no auth")
    protect_metrics: bool = _arg(False, "also require the API key on /metrics (/health always stays open)")
    max_waiting_requests: int | None = _arg(
        None, "answer 503 (with Retry-After) when this many requests already wait for admission "
              "(default: no limit); a request with more prompts than this can never be queued: 400", int)
    max_request_body_bytes: int = _arg(4 * MiB, "larger request bodies get 413, refused before parsing", int)
    max_n: int = _arg(16, "largest `n` (parallel samples) one request may ask for", int)
    # 256 = the default --max-num-seqs: one request cannot ask for more sequences than one
    # step runs, so it cannot monopolise the engine for many steps or balloon the response.
    max_choices_per_request: int = _arg(
        256, "largest number of prompts x n (the choices in the answer) one request may ask for; "
             "more get 400 before tokenizing", int)
    max_logprobs: int = _arg(20, "largest `logprobs` / `top_logprobs` one request may ask for", int)
    body_read_timeout: float = _arg(
        30.0, "answer 408 (and close the connection) when a request body has not fully arrived "
              "this many seconds after its headers (a stalled or trickling upload; inf: no limit)", float)
    request_timeout: float | None = _arg(
        None, "abort a request after this many seconds (408, or a final SSE error event once "
              "streaming); default: no timeout", float)
    shutdown_timeout: float = _arg(
        30.0, "on SIGTERM/SIGINT: refuse new requests (503), let running ones finish for this many "
              "seconds, then abort the rest", float)

    def __post_init__(self) -> None:
        if self.api_key is None:
            self.api_key = os.environ.get(API_KEY_ENV) or None

    def validate(self) -> None:
        for name in ("max_request_body_bytes", "max_n", "max_choices_per_request"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 1:
            raise ValueError(f"--max-waiting-requests must be >= 1 (0 would refuse every request), "
                             f"got {self.max_waiting_requests}")
        if not 0 <= self.max_logprobs <= 20:
            raise ValueError(f"--max-logprobs must be in [0, 20], got {self.max_logprobs}")
        if self.request_timeout is not None and not self.request_timeout > 0:
            raise ValueError(f"--request-timeout must be > 0 seconds, got {self.request_timeout}")
        if not self.body_read_timeout > 0:
            raise ValueError(f"--body-read-timeout must be > 0 seconds, got {self.body_read_timeout}")
        if not self.shutdown_timeout >= 0:
            raise ValueError(f"--shutdown-timeout must be >= 0 seconds, got {self.shutdown_timeout}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("--api-key must not be empty")


def add_server_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    add_dataclass_args(parser, ServerConfig, group="server limits and security")
    return parser


def server_config_from_namespace(ns: argparse.Namespace) -> ServerConfig:
    return dataclass_from_args(ServerConfig, ns)
