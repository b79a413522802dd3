"""The command line and environment a real vLLM engine is started with (no engine runs)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from narwhal.tools.vllm_fleet import LoraModule, LoraOptions, VllmEngine, VllmOptions, free_ports

OPTIONS = VllmOptions(
    python=Path("/venv/bin/python"),
    model=Path("/models/tiny"),
    served_model_name="tiny",
    log_dir=Path("/logs"),
    extra_args=("--reasoning-parser", "deepseek_r1"),
)
ADAPTER = LoraModule("tiny-sea", Path("/models/tiny/lora"))


def engine(options: VllmOptions) -> VllmEngine:
    return VllmEngine("p0", "prefill", 0, 8100, 5600, options)


def test_an_engine_without_lora_is_started_without_any_lora_flag_or_variable() -> None:
    command = engine(OPTIONS).command()
    assert not [arg for arg in command if "lora" in arg]
    assert command[-2:] == ["--reasoning-parser", "deepseek_r1"]
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in engine(OPTIONS).environment()


def test_lora_flags_name_each_adapter_with_the_served_model_as_its_parent() -> None:
    lora = LoraOptions(modules=(ADAPTER,), max_rank=8, max_loras=2)
    command = engine(replace(OPTIONS, lora=lora)).command()
    at = command.index("--enable-lora")
    assert command[at : at + 5] == ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "2"]
    module = json.loads(command[command.index("--lora-modules") + 1])
    assert module == {"name": "tiny-sea", "path": "/models/tiny/lora", "base_model_name": "tiny"}
    assert command[-2:] == ["--reasoning-parser", "deepseek_r1"], "extra arguments come last"


def test_runtime_updating_is_the_variable_vllm_reads_and_needs_no_module() -> None:
    lora = LoraOptions(runtime_updating=True)
    started = engine(replace(OPTIONS, lora=lora))
    assert started.environment()["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"
    assert "--enable-lora" in started.command()
    assert "--lora-modules" not in started.command()


def test_the_priority_policy_is_vllms_flag_and_fcfs_adds_none() -> None:
    assert "--scheduling-policy" not in engine(OPTIONS).command()
    command = engine(replace(OPTIONS, scheduling_policy="priority")).command()
    at = command.index("--scheduling-policy")
    assert command[at : at + 2] == ["--scheduling-policy", "priority"]
    assert command[-2:] == ["--reasoning-parser", "deepseek_r1"], "extra arguments come last"


def test_ports_are_chosen_free_and_outside_the_ephemeral_range() -> None:
    ports = free_ports(8)
    assert len(set(ports)) == 8
    # The kernel never hands these to an outgoing connection (Linux: 32768 and up).
    assert all(20000 <= port < 32768 for port in ports)
