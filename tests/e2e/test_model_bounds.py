"""Each model's own leg bounds: a `[[models]]` entry's `engine` timeouts bound that model's
requests alone, and the other models keep `[engine]`'s."""

from __future__ import annotations

from support.stack import COMPLETION, MODEL, StackFactory, arm

# Pool narwhal-sim (the default model, `[engine]`'s bounds) and pool model-b (its own).
TWO_POOLS = (("p0", "prefill"), ("d0", "decode"), ("pb", "prefill"), ("db", "decode"))
POOL_B = {"model": "model-b"}
STREAM = {**COMPLETION, "stream": True}


async def test_a_models_short_first_token_bound_fails_it_while_the_others_longer_one_holds(
    make_stack: StackFactory,
) -> None:
    async with make_stack(
        TWO_POOLS,
        sim_by_engine={"pb": POOL_B, "db": POOL_B},
        engine_keys={"pb": POOL_B, "db": POOL_B},
        engine={"first_token_timeout_s": 30.0},
        serving={"max_attempts": 1},
        models=[{"name": "model-b", "engine": {"first_token_timeout_s": 0.3}}],
    ) as stack:
        # Both pools' consumers are as slow to their first token.
        for name in ("d0", "db"):
            arm(stack.engine(name), phase="decode", first_token_delay_s=1.0)
        status, body = await stack.post("/v1/completions", {**STREAM, "model": "model-b"})
        assert status == 504, body
        message = body["error"]["message"]
        assert message.endswith("produced no token within the first-token timeout (0.3 s)")
        status, body = await stack.post("/v1/completions", {**STREAM, "model": MODEL})
        assert status == 200, body
        lines = await stack.journal(2, kind="request")
        assert [(line["model"], line["status"]) for line in lines] == [
            ("model-b", 504),
            (MODEL, 200),
        ]
