"""Everything one simulated engine is configured with, and the `narwhal sim` flags for it.

The default timings look like a small model on one GPU, scaled so a dev fleet feels real:
~0.1 ms per prompt token, 5 ms per request, 20 ms between tokens. Defaults that vLLM 0.32
sets follow it: the KV block size of the device (16 on a GPU, 128 on CPU) and the
NixlConnector's 30 s lease on blocks held for a pull (`kv_lease_duration`).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import Literal

from narwhal.sim.faults import Fault, FaultError

FailurePolicy = Literal["fail", "recompute"]
Device = Literal["cuda", "cpu"]
ReasoningField = Literal["reasoning", "reasoning_content"]

# vLLM 0.32's block size when none is given: CacheConfig.DEFAULT_BLOCK_SIZE, and 128 on CPU.
_DEVICE_BLOCK_SIZE: dict[str, int] = {"cuda": 16, "cpu": 128}


@dataclass(frozen=True, slots=True)
class SimOptions:
    """One engine's configuration; `port`/`side_channel_port` 0 pick free ports."""

    host: str = "127.0.0.1"
    port: int = 0
    name: str = "sim"
    model: str = "narwhal-sim"
    engine_id: str | None = None
    version: str = "0.11.0"
    max_model_len: int = 8192
    device: Device = "cuda"
    block_size: int | None = None  # None: the device's default
    tp_size: int = 1
    side_channel_host: str | None = None
    side_channel_port: int = 0
    kv_lease_s: float = 30.0
    kv_load_failure_policy: FailurePolicy = "fail"
    max_num_seqs: int = 256
    num_kv_blocks: int = 8192
    prefill_s_per_token: float = 0.0001
    request_overhead_s: float = 0.005
    inter_token_s: float = 0.02
    kv_pull_s_per_block: float = 0.0002
    slowdown_per_seq: float = 0.01
    eos_probability: float = 0.0
    empty_token_probability: float = 0.0  # per token: it detokenizes to nothing
    reasoning_tokens: int = 0  # chat: this many first tokens are reasoning (a parser is on)
    reasoning_field: ReasoningField = "reasoning"  # older vLLM: reasoning_content
    enable_prompt_tokens_details: bool = False  # usage reports cached prompt tokens
    faults_enabled: bool = False
    faults: tuple[Fault, ...] = ()

    def __post_init__(self) -> None:
        for name in ("max_model_len", "tp_size", "max_num_seqs", "num_kv_blocks"):
            _require(self, name, getattr(self, name) >= 1, "must be at least 1")
        _require(
            self,
            "block_size",
            self.block_size is None or self.block_size >= 1,
            "must be at least 1",
        )
        _require(self, "device", self.device in _DEVICE_BLOCK_SIZE, "must be 'cuda' or 'cpu'")
        _require(self, "reasoning_tokens", self.reasoning_tokens >= 0, "must not be negative")
        _require(
            self,
            "reasoning_field",
            self.reasoning_field in ("reasoning", "reasoning_content"),
            "must be 'reasoning' or 'reasoning_content'",
        )
        for name in ("port", "side_channel_port"):
            _require(self, name, 0 <= getattr(self, name) <= 65535, "must be a TCP port")
        for name in (
            "kv_lease_s",
            "prefill_s_per_token",
            "request_overhead_s",
            "inter_token_s",
            "kv_pull_s_per_block",
            "slowdown_per_seq",
        ):
            _require(self, name, getattr(self, name) >= 0, "must not be negative")
        for name in ("eos_probability", "empty_token_probability"):
            _require(self, name, 0 <= getattr(self, name) <= 1, "must be in [0, 1]")
        _require(
            self,
            "kv_load_failure_policy",
            self.kv_load_failure_policy in ("fail", "recompute"),
            "must be 'fail' or 'recompute'",
        )
        _require(self, "faults", self.faults_enabled or not self.faults, "need faults_enabled")

    @property
    def kv_block_size(self) -> int:
        """Tokens per KV block: as given, or the device's default."""
        return self.block_size or _DEVICE_BLOCK_SIZE[self.device]

    @property
    def resolved_side_channel_host(self) -> str:
        """The side channel's host, bound and put in descriptors (VLLM_NIXL_SIDE_CHANNEL_HOST)."""
        return self.side_channel_host or self.host


def _require(options: SimOptions, name: str, ok: bool, rule: str) -> None:
    if not ok:
        raise ValueError(f"sim option {name}: {rule}, got {getattr(options, name)!r}")


def _fault(text: str) -> Fault:
    try:
        return Fault.parse(text)
    except FaultError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def add_sim_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one flag per SimOptions field (`--id` sets `name`)."""
    d = SimOptions()
    add = parser.add_argument
    add("--host", default=d.host, help="HTTP listen address")
    add("--port", type=int, default=8000, help="HTTP port (0 picks a free one)")
    add("--id", dest="name", default=d.name, help="engine name used in logs")
    add("--model", default=d.model, help="served model name")
    add("--engine-id", default=d.engine_id, help="fixed engine identity (default: fresh uuid)")
    add("--version", default=d.version, help="vLLM version reported by /version")
    add("--max-model-len", type=int, default=d.max_model_len, help="prompt + output limit")
    add("--device", choices=("cuda", "cpu"), default=d.device, help="the device modelled")
    add(
        "--block-size",
        type=int,
        default=d.block_size,
        help="tokens per KV block (default: 16 on cuda, 128 on cpu)",
    )
    add("--tp-size", type=int, default=d.tp_size, help="tensor-parallel size reported")
    add("--side-channel-host", default=d.side_channel_host, help="KV host (default: --host)")
    add("--side-channel-port", type=int, default=d.side_channel_port, help="KV port (0: free)")
    add("--kv-lease-s", type=float, default=d.kv_lease_s, help="held blocks expire after this")
    add(
        "--kv-load-failure-policy",
        choices=("fail", "recompute"),
        default=d.kv_load_failure_policy,
        help="what a decode does when its KV pull fails",
    )
    add("--max-num-seqs", type=int, default=d.max_num_seqs, help="running requests at most")
    add("--num-kv-blocks", type=int, default=d.num_kv_blocks, help="KV block budget")
    add("--prefill-s-per-token", type=float, default=d.prefill_s_per_token, help="prefill cost")
    add("--request-overhead-s", type=float, default=d.request_overhead_s, help="per request")
    add("--inter-token-s", type=float, default=d.inter_token_s, help="decode step (0 allowed)")
    add("--kv-pull-s-per-block", type=float, default=d.kv_pull_s_per_block, help="pull cost")
    add("--slowdown-per-seq", type=float, default=d.slowdown_per_seq, help="per running seq")
    add("--eos-probability", type=float, default=d.eos_probability, help="per token")
    add(
        "--empty-token-probability",
        type=float,
        default=d.empty_token_probability,
        help="per token: it detokenizes to nothing (a skipped special token)",
    )
    add(
        "--reasoning-tokens",
        type=int,
        default=d.reasoning_tokens,
        help="chat: the first N tokens are reasoning, as with a reasoning parser",
    )
    add(
        "--reasoning-field",
        choices=("reasoning", "reasoning_content"),
        default=d.reasoning_field,
        help="where reasoning goes (reasoning_content: older vLLM)",
    )
    add(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="usage reports prompt_tokens_details.cached_tokens",
    )
    add("--enable-faults", dest="faults_enabled", action="store_true", help="serve /sim/faults")
    add(
        "--fault",
        dest="faults",
        type=_fault,
        action="append",
        default=[],
        help="arm a fault (JSON object); repeatable; implies --enable-faults",
    )


def options_from_args(args: argparse.Namespace) -> SimOptions:
    """Build SimOptions from parsed flags; raises ValueError naming a bad option."""
    values = {field.name: getattr(args, field.name) for field in fields(SimOptions)}
    values["faults"] = tuple(args.faults)
    values["faults_enabled"] = args.faults_enabled or bool(args.faults)
    return SimOptions(**values)
