"""`narwhal sim` flags map one to one onto SimOptions, validated at start-up."""

from __future__ import annotations

import argparse

import pytest

from narwhal.tools.sim.faults import Fault
from narwhal.tools.sim.options import SimOptions, add_sim_arguments, options_from_args


def _parse(*argv: str) -> SimOptions:
    parser = argparse.ArgumentParser()
    add_sim_arguments(parser)
    return options_from_args(parser.parse_args(argv))


def test_flags_set_the_matching_fields() -> None:
    options = _parse(
        "--host", "0.0.0.0", "--port", "9000", "--id", "p0", "--model", "m",
        "--engine-id", "e1", "--block-size", "32", "--kv-lease-s", "30",
        "--kv-load-failure-policy", "recompute", "--inter-token-s", "0",
        "--side-channel-port", "5600", "--num-kv-blocks", "100",
    )  # fmt: skip
    assert (options.host, options.port, options.name, options.model) == ("0.0.0.0", 9000, "p0", "m")
    assert (options.engine_id, options.block_size, options.kv_lease_s) == ("e1", 32, 30.0)
    assert options.kv_load_failure_policy == "recompute"
    assert (options.inter_token_s, options.side_channel_port) == (0.0, 5600)
    assert options.num_kv_blocks == 100
    assert not options.faults_enabled


def test_defaults_match_the_options_object_except_the_cli_port() -> None:
    assert _parse() == SimOptions(port=8000)


def test_fault_flags_arm_faults_and_enable_the_control_route() -> None:
    options = _parse("--fault", '{"status": 503}', "--fault", '{"crash": true, "times": 1}')
    assert options.faults == (Fault(status=503), Fault(times=1, crash=True))
    assert options.faults_enabled


def test_a_bad_fault_flag_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _parse("--fault", '{"stauts": 503}')
    assert "stauts" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("field", "value"),
    [("block_size", 0), ("port", 70000), ("inter_token_s", -1.0), ("eos_probability", 2.0)],
)
def test_bad_values_are_rejected_naming_the_option(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"sim option {field}"):
        SimOptions(**{field: value})  # type: ignore[arg-type]


def test_faults_need_faults_enabled() -> None:
    with pytest.raises(ValueError, match="faults"):
        SimOptions(faults=(Fault(status=500),))


def test_lora_flags_set_the_adapters_as_vllm_spells_them() -> None:
    options = _parse(
        "--model",
        "base",
        "--lora-modules",
        "sql=/a/sql",
        '{"name": "poet", "path": "/a/poet"}',
        "--lora-modules",
        "x=/a/x",
        "--runtime-lora-updating",
        "--check-lora-paths",
    )
    assert options.lora_modules == (("sql", "/a/sql"), ("poet", "/a/poet"), ("x", "/a/x"))
    assert options.runtime_lora_updating and options.check_lora_paths
    assert _parse().lora_modules == () and not _parse().runtime_lora_updating


def test_a_bad_lora_module_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _parse("--lora-modules", "sql")
    assert "name=path" in capsys.readouterr().err


@pytest.mark.parametrize("modules", [(("m", "/a"),), (("a", "/a"), ("a", "/b"))])
def test_adapter_names_are_unique_and_not_the_models(modules: tuple[tuple[str, str], ...]) -> None:
    with pytest.raises(ValueError, match="lora_modules"):
        SimOptions(model="m", lora_modules=modules)


def test_the_scheduling_policy_flag_is_vllms() -> None:
    assert _parse().scheduling_policy == "fcfs"
    assert _parse("--scheduling-policy", "priority").scheduling_policy == "priority"
    with pytest.raises(ValueError, match="sim option scheduling_policy"):
        SimOptions(scheduling_policy="lifo")  # type: ignore[arg-type]


def test_an_unknown_scheduling_policy_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _parse("--scheduling-policy", "lifo")
    assert "scheduling-policy" in capsys.readouterr().err
