"""Everything one simulated engine is configured with, and the `narwhal sim` flags for it.

The default timings (the `dev` profile) look like a small model on one GPU, scaled so a dev
fleet feels real: ~0.1 ms per prompt token, 5 ms per request, 20 ms between tokens; other
profiles (narwhal.tools.sim.profiles) model a named model on a GPU. Defaults that vLLM 0.32
sets follow it: the KV block size of the device (16 on a GPU, 128 on CPU) and the
NixlConnector's 30 s lease on blocks held for a pull (`kv_lease_duration`).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import Any, Literal

from narwhal.tools.sim.faults import Fault, FaultError
from narwhal.tools.sim.lora import parse_lora_module
from narwhal.tools.sim.profiles import PROFILE_FIELDS, PROFILES, profile
from narwhal.tools.sim.scheduler import SchedulingPolicy
from narwhal.tools.sim.timing import PullCosts, StepCosts

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
    # vLLM's `--scheduling-policy`: the waiting queue by arrival, or by `priority` first.
    scheduling_policy: SchedulingPolicy = "fcfs"
    # Timing (see narwhal.tools.sim.timing and docs/simulator-timing.md); `--profile` sets them.
    prefill_s_per_token: float = 0.0001
    request_overhead_s: float = 0.005
    inter_token_s: float = 0.02
    kv_pull_s_per_block: float = 0.0002
    slowdown_per_seq: float = 0.01
    step_overhead_s: float = 0.0
    kv_read_s_per_token: float = 0.0
    max_num_batched_tokens: int = 8192
    kv_bytes_per_token: int = 0
    kv_pull_latency_s: float = 0.0
    kv_pull_bytes_per_s: float = 0.0  # 0: no size cost, only kv_pull_s_per_block
    speed: float = 1.0  # every simulated duration is divided by this
    eos_probability: float = 0.0
    empty_token_probability: float = 0.0  # per token: it detokenizes to nothing
    reasoning_tokens: int = 0  # chat: this many first tokens are reasoning (a parser is on)
    reasoning_field: ReasoningField = "reasoning"  # older vLLM: reasoning_content
    enable_prompt_tokens_details: bool = False  # usage reports cached prompt tokens
    faults_enabled: bool = False
    faults: tuple[Fault, ...] = ()
    # LoRA adapters served over `model` from the start, (name, path) pairs.
    lora_modules: tuple[tuple[str, str], ...] = ()
    # Serve /v1/load_lora_adapter and /v1/unload_lora_adapter (VLLM_ALLOW_RUNTIME_LORA_UPDATING).
    runtime_lora_updating: bool = False
    # Load only adapter paths that exist here; a missing one fails as in vLLM (a 404).
    check_lora_paths: bool = False

    def __post_init__(self) -> None:
        for name in (
            "max_model_len",
            "tp_size",
            "max_num_seqs",
            "num_kv_blocks",
            "max_num_batched_tokens",
        ):
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
            "scheduling_policy",
            self.scheduling_policy in ("fcfs", "priority"),
            "must be 'fcfs' or 'priority'",
        )
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
            "step_overhead_s",
            "kv_read_s_per_token",
            "kv_bytes_per_token",
            "kv_pull_latency_s",
            "kv_pull_bytes_per_s",
        ):
            _require(self, name, getattr(self, name) >= 0, "must not be negative")
        _require(self, "speed", self.speed > 0, "must be more than 0")
        for name in ("eos_probability", "empty_token_probability"):
            _require(self, name, 0 <= getattr(self, name) <= 1, "must be in [0, 1]")
        _require(
            self,
            "kv_load_failure_policy",
            self.kv_load_failure_policy in ("fail", "recompute"),
            "must be 'fail' or 'recompute'",
        )
        _require(self, "faults", self.faults_enabled or not self.faults, "need faults_enabled")
        names = [name for name, _ in self.lora_modules]
        _require(
            self,
            "lora_modules",
            len(set(names)) == len(names) and self.model not in names,
            "adapter names must be unique and not the model's",
        )

    @property
    def kv_block_size(self) -> int:
        """Tokens per KV block: as given, or the device's default."""
        return self.block_size or _DEVICE_BLOCK_SIZE[self.device]

    @property
    def step_costs(self) -> StepCosts:
        """The engine's step costs, at its `speed`."""
        return StepCosts(
            step_overhead_s=self.step_overhead_s,
            prefill_s_per_token=self.prefill_s_per_token,
            inter_token_s=self.inter_token_s,
            slowdown_per_seq=self.slowdown_per_seq,
            kv_read_s_per_token=self.kv_read_s_per_token,
            max_num_batched_tokens=self.max_num_batched_tokens,
        ).scaled(self.speed)

    @property
    def pull_costs(self) -> PullCosts:
        """The cost of pulling KV blocks into this engine, at its `speed`."""
        return PullCosts(
            latency_s=self.kv_pull_latency_s,
            s_per_block=self.kv_pull_s_per_block,
            bytes_per_token=self.kv_bytes_per_token,
            bytes_per_s=self.kv_pull_bytes_per_s,
        ).scaled(self.speed)

    @property
    def resolved_side_channel_host(self) -> str:
        """The side channel's host, bound and put in descriptors (VLLM_NIXL_SIDE_CHANNEL_HOST)."""
        return self.side_channel_host or self.host


def _require(options: SimOptions, name: str, ok: bool, rule: str) -> None:
    if not ok:
        raise ValueError(f"sim option {name}: {rule}, got {getattr(options, name)!r}")


_DEFAULTS = SimOptions()


def _fault(text: str) -> Fault:
    try:
        return Fault.parse(text)
    except FaultError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _lora_module(text: str) -> tuple[str, str]:
    try:
        return parse_lora_module(text)
    except ValueError as exc:
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
    add("--side-channel-host", default=d.side_channel_host, help="KV host (default: --host)")
    add("--side-channel-port", type=int, default=d.side_channel_port, help="KV port (0: free)")
    add("--kv-lease-s", type=float, default=d.kv_lease_s, help="held blocks expire after this")
    add(
        "--kv-load-failure-policy",
        choices=("fail", "recompute"),
        default=d.kv_load_failure_policy,
        help="what a decode does when its KV pull fails",
    )
    _add_timing_arguments(parser)
    add(
        "--scheduling-policy",
        choices=("fcfs", "priority"),
        default=d.scheduling_policy,
        help="the waiting queue's order, as vLLM's flag: fcfs (arrival) or priority (each "
        "request's `priority`, lower first, then arrival)",
    )
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
        "--lora-modules",
        nargs="+",
        action="extend",
        type=_lora_module,
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapters served over --model (vLLM's syntax); repeatable",
    )
    add(
        "--runtime-lora-updating",
        action="store_true",
        help="serve /v1/load_lora_adapter and /v1/unload_lora_adapter, as vLLM with "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1",
    )
    add(
        "--check-lora-paths",
        action="store_true",
        help="load only adapter paths that exist on this machine (a missing one: vLLM's 404)",
    )
    add(
        "--fault",
        dest="faults",
        type=_fault,
        action="append",
        default=[],
        help="arm a fault (JSON object); repeatable; implies --enable-faults",
    )


_TIMING_HELP = {
    "request_overhead_s": "per request, before it is scheduled (HTTP, tokenizing)",
    "step_overhead_s": "every engine step (scheduling, kernel launches)",
    "prefill_s_per_token": "each prompt token computed in a step",
    "inter_token_s": "a decode step's floor: the weights read once (0 allowed)",
    "slowdown_per_seq": "each decoding sequence beyond the first adds this share of it",
    "kv_read_s_per_token": "each context token of every decoding sequence, per step",
    "max_num_batched_tokens": "token budget of one step, decodes and prompt chunks",
    "max_num_seqs": "running requests at most",
    "num_kv_blocks": "KV block budget",
    "tp_size": "tensor-parallel size reported",
    "kv_bytes_per_token": "KV bytes per token, for the size of a pull",
    "kv_pull_latency_s": "fixed cost of a KV pull",
    "kv_pull_s_per_block": "KV pull cost per block",
    "kv_pull_bytes_per_s": "KV pull link bandwidth (0: no size cost)",
}


def _add_timing_arguments(parser: argparse.ArgumentParser) -> None:
    """`--profile` and one flag per profile field; a flag given overrides the profile."""
    d = SimOptions()
    parser.add_argument(
        "--profile",
        default="dev",
        choices=sorted(PROFILES),
        help="preset timings of a model on a GPU (default: dev, fast and small)",
    )
    for name in PROFILE_FIELDS:
        kind = type(getattr(d, name))
        parser.add_argument(
            "--" + name.replace("_", "-"),
            type=kind,
            default=None,
            help=f"{_TIMING_HELP[name]} (default: the profile's; dev {getattr(d, name)})",
        )
    parser.add_argument(
        "--speed",
        type=float,
        default=d.speed,
        help="run this many times faster than the profile: every simulated duration / SPEED",
    )


def profile_options(preset: str, /, **overrides: Any) -> SimOptions:
    """SimOptions with a preset profile's values, then `overrides`."""
    values: dict[str, Any] = dict(profile(preset))
    values.update(overrides)
    return SimOptions(**values)


def options_from_args(args: argparse.Namespace) -> SimOptions:
    """Build SimOptions from parsed flags; raises ValueError naming a bad option."""
    values = {field.name: getattr(args, field.name) for field in fields(SimOptions)}
    preset = profile(getattr(args, "profile", "dev"))
    for name in PROFILE_FIELDS:
        if values[name] is None:
            values[name] = preset.get(name, getattr(_DEFAULTS, name))
    values["faults"] = tuple(args.faults)
    values["lora_modules"] = tuple(args.lora_modules)
    values["faults_enabled"] = args.faults_enabled or bool(args.faults)
    return SimOptions(**values)
