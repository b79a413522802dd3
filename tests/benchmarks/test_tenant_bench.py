"""`narwhal bench --tenant`: the router it starts has the tenants' `[[tenants]]` and seats
that make it queue; each tenant's lengths come from its spec, its shape or the fleet's."""

from __future__ import annotations

import tomllib

import pytest
from bench_targets import narwhal_config
from tenant_bench import FleetShape, parser, shaped

from narwhal.config.root import parse_config
from narwhal.tools.goodput.tenants import parse_tenant


def test_the_routers_configuration_has_each_tenant_and_limited_decode_seats() -> None:
    tenants = [
        parse_tenant("a:priority=1,requests_per_minute=600,rate=5"),
        parse_tenant("b:weight=3,concurrency=2,key=kb"),
    ]
    text = narwhal_config(
        "http://127.0.0.1:9001",
        "http://127.0.0.1:9002",
        8000,
        settings=FleetShape().router_settings(),
        tenants=[tenant.tenant_table() for tenant in tenants],
        decode_seats=32,
    )
    config = parse_config(tomllib.loads(text))
    assert [t.name for t in config.tenants] == ["a", "b"]
    assert config.tenants[0].priority == 1 and config.tenants[0].requests_per_minute == 600
    assert config.tenants[1].weight == 3 and config.tenants[1].api_keys == ("kb",)
    consumer = next(e for e in config.engines if e.id == "consumer")
    assert consumer.max_decode_seats == 32
    assert config.serving.queue_capacity == FleetShape().queue_capacity


def test_lengths_come_from_the_spec_then_the_bench_shape_then_the_fleet() -> None:
    shape = FleetShape(prompt_tokens=100, max_tokens=50)
    a, b, c = shaped(
        [
            parse_tenant("a:rate=1,max_tokens=9,prompt_tokens=3"),
            parse_tenant("b:rate=1,shape=long"),
            parse_tenant("c:rate=1"),
        ],
        shape,
    )
    assert (a.prompt_tokens, a.max_tokens) == (3, 9)
    assert (b.prompt_tokens, b.max_tokens) == (100, 1024)
    assert (c.prompt_tokens, c.max_tokens) == (100, 50)
    with pytest.raises(ValueError, match="shape"):
        shaped([parse_tenant("d:rate=1,shape=mixed-nonstream")], shape)


def test_the_engines_run_as_many_sequences_as_the_router_has_decode_seats() -> None:
    settings = FleetShape(decode_seats=48, profile="llama-3.1-8b-h100").sim_settings()
    assert settings.max_num_seqs == 48 and settings.profile == "llama-3.1-8b-h100"
    slo = FleetShape().slo()
    assert 0 < slo.tpot_s < slo.ttft_s
    # At half speed every duration doubles, the SLOs with them.
    slow = FleetShape(speed=0.5).slo()
    assert slow.ttft_s == pytest.approx(2 * slo.ttft_s)


def test_the_command_needs_a_tenant() -> None:
    with pytest.raises(SystemExit):
        parser().parse_args([])
    args = parser().parse_args(["--tenant", "a:rate=2", "--tenant", "b:concurrency=1"])
    assert [t.name for t in args.tenant] == ["a", "b"]
