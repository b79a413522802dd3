"""The simulator's token ids: reported as vLLM 0.32 reports them with `return_token_ids`,
and generated so that a prompt P + G goes on exactly as P did after G."""

from __future__ import annotations

from narwhal.tools.sim.model import Generation, Sampling, tokenize
from support.stack import CHAT, COMPLETION, StackFactory, sse_payloads


def _run(prompt: list[int], sampling: Sampling, max_tokens: int) -> Generation:
    generation = Generation(prompt, sampling, max_tokens=max_tokens, empty_probability=0.2)
    while generation.finish_reason is None:
        generation.step()
    return generation


def test_a_prompt_extended_by_its_output_continues_it_exactly() -> None:
    prompt = tokenize("The sea is deep and the whales sing")
    for sampling in (Sampling(temperature=0.0), Sampling(temperature=0.8, seed=5)):
        whole = _run(prompt, sampling, 30)
        for cut in (1, 7, 29):
            rest = _run(prompt + whole.token_ids[:cut], sampling, 30 - cut)
            assert whole.token_ids[cut:] == rest.token_ids


async def test_streams_carry_prompt_ids_once_and_each_tokens_ids(
    make_stack: StackFactory,
) -> None:
    async with make_stack() as stack:
        body = {**COMPLETION, "stream": True, "return_token_ids": True}
        _, text = await stack.post_to_engine("d0", "/v1/completions", body)
        choices = [p["choices"][0] for p in sse_payloads(text)]
        assert isinstance(choices[0]["prompt_token_ids"], list)
        assert all(c["prompt_token_ids"] is None for c in choices[1:])
        assert all(len(c["token_ids"]) == 1 for c in choices)
        chat = {**CHAT, "stream": True, "return_token_ids": True}
        _, text = await stack.post_to_engine("d0", "/v1/chat/completions", chat)
        payloads = sse_payloads(text)
        assert isinstance(payloads[0]["prompt_token_ids"], list)
        assert all(len(p["choices"][0]["token_ids"]) == 1 for p in payloads[1:])
        _, plain = await stack.post_to_engine("d0", "/v1/completions", {**body, "stream": False})
        assert len(plain["choices"][0]["token_ids"]) == COMPLETION["max_tokens"]
        assert isinstance(plain["choices"][0]["prompt_token_ids"], list)
