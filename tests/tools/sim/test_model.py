"""The simulated model: tokenizer, chat template and deterministic generation."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from narwhal.tools.sim.model import VOCAB, VOCAB_SIZE, Generation, Sampling, chat_prompt, tokenize

PROMPT = tokenize("Where do narwhals go in winter?")


def _run(generation: Generation) -> list[str]:
    deltas = []
    while generation.finish_reason is None:
        deltas.append(generation.step())
    return deltas


def test_tokenizer_is_deterministic_and_splits_words_and_punctuation() -> None:
    assert tokenize("Hello, world!") == tokenize("Hello, world!")
    assert len(tokenize("Hello, world!")) == 4
    assert tokenize("Hello") != tokenize("hello")
    assert all(0 <= token < VOCAB_SIZE for token in tokenize("any text at all ☃"))


def test_chat_template_renders_every_message_then_the_reply_cue() -> None:
    prompt = chat_prompt([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}])
    assert prompt == "<|system|>\nS<|end|>\n<|user|>\nU<|end|>\n<|assistant|>\n"


def test_generation_runs_to_max_tokens_from_the_vocabulary() -> None:
    generation = Generation(PROMPT, Sampling(), max_tokens=6)
    deltas = _run(generation)
    assert len(deltas) == generation.completion_tokens == 6
    assert all(delta in VOCAB for delta in deltas)
    assert generation.finish_reason == "length"
    assert generation.text == "".join(deltas)


def test_shorter_limit_yields_a_prefix_of_the_longer_run() -> None:
    short = Generation(PROMPT, Sampling(seed=3), max_tokens=4)
    long = Generation(PROMPT, Sampling(seed=3), max_tokens=40)
    _run(short), _run(long)
    assert long.text.startswith(short.text)


def test_seed_matters_only_when_sampling() -> None:
    def text(temperature: float, seed: int) -> str:
        generation = Generation(PROMPT, Sampling(temperature, seed), max_tokens=8)
        _run(generation)
        return generation.text

    assert text(0.0, 1) == text(0.0, 2)
    assert text(1.0, 1) != text(1.0, 2)
    assert text(0.5, 1) != text(1.0, 1)


def test_weights_change_the_text_even_when_greedy() -> None:
    def text(weights: str | None, temperature: float = 0.0) -> str:
        generation = Generation(PROMPT, Sampling(temperature), max_tokens=8, weights=weights)
        _run(generation)
        return generation.text

    assert text("sql") == text("sql")
    assert len({text(None), text("sql"), text("poet"), text("")}) == 4
    assert text("sql", 1.0) != text(None, 1.0)


def test_certain_eos_stops_at_the_first_token_with_no_text() -> None:
    generation = Generation(PROMPT, Sampling(), max_tokens=5, eos_probability=1.0)
    assert _run(generation) == [""]
    assert (generation.finish_reason, generation.completion_tokens) == ("stop", 1)


@given(
    prompt=st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=20),
    max_tokens=st.integers(1, 60),
    stop_spans=st.lists(st.tuples(st.integers(0, 400), st.integers(1, 12)), max_size=3),
)
def test_stop_strings_cut_the_text_right_before_the_first_match(
    prompt: list[int], max_tokens: int, stop_spans: list[tuple[int, int]]
) -> None:
    free = Generation(prompt, Sampling(), max_tokens=max_tokens)
    _run(free)
    stops = [free.text[start : start + size] for start, size in stop_spans] + ["@"]
    stopped = Generation(prompt, Sampling(), max_tokens=max_tokens, stop=stops)
    deltas = _run(stopped)
    assert "".join(deltas) == stopped.text
    assert free.text.startswith(stopped.text)
    assert not any(stop and stop in stopped.text for stop in stops)
    if stopped.finish_reason == "stop":
        rest = free.text[len(stopped.text) :]
        assert any(stop and rest.startswith(stop) for stop in stops)
    else:
        assert stopped.text == free.text
        assert stopped.completion_tokens == max_tokens
