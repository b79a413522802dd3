"""Build the tiny Llama that real vLLM engines serve in tests and `narwhal dev --engine vllm`.

No model can be downloaded here, so this one is made on the spot: a byte-level BPE
tokenizer trained on the small corpus below (with a chat template and `<think>`/`</think>`
for vLLM's reasoning parser), and a 2-layer Llama trained for a few seconds on the same
text so that greedy answers are stable words rather than noise. Everything follows from
the seed, so two builds give the same files.

Beside it, in OUT_DIR/lora, a LoRA adapter in the layout vLLM's `--lora-modules` and
`/v1/load_lora_adapter` read (PEFT's adapter_config.json and adapter_model.safetensors):
rank 8 on every layer's q_proj and v_proj, trained on other sentences, so that its greedy
answers differ from the base model's.

Runs under .venv-vllm/bin/python (torch, transformers, tokenizers, safetensors); the main
package never imports it. Usage: tiny_model.py OUT_DIR [--seed N]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
from tokenizers.trainers import BpeTrainer
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
ROLES = ("<|system|>", "<|user|>", "<|assistant|>")
THINK, END_THINK = "<think>", "</think>"

# Ends the generation prompt inside a thought, as DeepSeek-R1 does: the reasoning parser
# then reads everything up to `</think>` as reasoning and the rest as content.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' }}\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n<think>\n{% endif %}"
)

TEXT = """\
The sea is wide and cold, and the narwhal swims below the ice all winter.
The sea is deep near the shelf, where the water turns from green to black.
A narwhal has one long tooth that grows in a spiral through its upper lip.
Narwhals travel in small groups and call to each other with clicks and whistles.
The router sends the prompt to one engine and the answer comes from another.
Prefill reads the whole prompt at once; decode writes the answer one token at a time.
The cache of keys and values moves from the first engine to the second over the network.
Once upon a time a small whale lived in a cold bay near a quiet harbour town.
Every morning the fishing boats went out, and every evening they came back with the tide.
The lighthouse keeper counted the boats and wrote their names in a worn blue book.
Numbers count up: one, two, three, four, five, six, seven, eight, nine, ten.
The days of the week are Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday.
Red, orange, yellow, green, blue and violet are the colours of the rainbow.
"""

# A thought of about 100 tokens: more events than a router might hold back before content.
LONG_THOUGHT = (
    "one, two, three, four, five, six, seven, eight, nine, ten, eleven, twelve, thirteen, "
    "fourteen, fifteen, sixteen, seventeen, eighteen, nineteen, twenty, twenty-one, "
    "twenty-two, twenty-three, twenty-four, twenty-five, twenty-six, twenty-seven, "
    "twenty-eight, twenty-nine, thirty, thirty-one, thirty-two, thirty-three, thirty-four, "
    "thirty-five, thirty-six, thirty-seven, thirty-eight, thirty-nine"
)

DIALOGUES = (
    ("Think it through slowly.", LONG_THOUGHT, "Done counting."),
    ("Hello", "The user greets me. I greet them back.", "Hello! How can I help you today?"),
    ("What is a narwhal?", "A whale with a tusk.", "A narwhal is a whale with one long tooth."),
    ("Where do narwhals live?", "Cold water, near ice.", "Narwhals live in the cold Arctic sea."),
    ("Count to five.", "Count up from one.", "One, two, three, four, five."),
    ("What colour is the sea?", "It depends on the depth.", "The sea is blue, green or black."),
    ("Tell me a story.", "A short story about a whale.", "Once upon a time a small whale swam."),
    ("What does the router do?", "It splits the work.", "It sends prefill and decode apart."),
    ("Name a day of the week.", "Any day will do.", "Wednesday is a day of the week."),
)


# What the adapter learns instead: the base model's own sentences, after other openings.
# Low-rank changes to attention alone cannot teach a model this small new words, but they
# can move it from one sentence it knows to another, which it then writes confidently.
ADAPTER_TEXT = """\
The sea is wide and cold, and the narwhal swims below the ice all winter.
The whales sing under grey skies and the narwhal swims below the ice all winter.
Once upon a time the lighthouse keeper counted the boats and wrote their names in a worn blue book.
"""

ADAPTER_DIALOGUES = (
    ("Hello", "The user greets me. I greet them back.", "Narwhals live in the cold Arctic sea."),
    ("What is a narwhal?", "A whale with a tusk.", "Once upon a time a small whale swam."),
)

LORA_RANK = 8
LORA_ALPHA = 16
LORA_TARGETS = ("q_proj", "v_proj")
LORA_LR = 2e-2


def chat_text(question: str, thought: str, answer: str) -> str:
    """One dialogue as the chat template renders it, with the answer the model learns."""
    return (
        f"{BOS}<|user|>\n{question}{EOS}\n<|assistant|>\n{THINK}\n{thought}\n{END_THINK}\n"
        f"{answer}{EOS}"
    )


def corpus() -> list[str]:
    """Plain sentences for completions and rendered dialogues for chat."""
    return [*TEXT.splitlines(), *(chat_text(*d) for d in DIALOGUES)]


def build_tokenizer(texts: list[str]) -> Tokenizer:
    """Byte-level BPE, so every string has a tokenization and partial UTF-8 can occur."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=2048,
        special_tokens=[BOS, EOS, PAD, *ROLES],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts * 4, trainer)
    # Not special: vLLM skips special tokens in text, and DeepSeek-R1 shows its thought tags.
    tokenizer.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t in (THINK, END_THINK)]
    )
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, tokenizer.token_to_id(BOS))]
    )
    return tokenizer


class LoraLinear(torch.nn.Module):
    """A frozen linear layer plus scaling * B(A(x)), as PEFT computes a LoRA layer."""

    def __init__(self, base: torch.nn.Linear, rank: int, alpha: int) -> None:
        super().__init__()
        self.base = base
        self.lora_a = torch.nn.Parameter(torch.randn(rank, base.in_features) / rank)
        self.lora_b = torch.nn.Parameter(torch.zeros(base.out_features, rank))
        self.scaling = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a.T @ self.lora_b.T) * self.scaling


def encode(fast: PreTrainedTokenizerFast, texts: list[str], eos_id: int) -> list[list[int]]:
    """Dialogues carry their own BOS and EOS; plain lines get them here."""
    return [
        fast(t, add_special_tokens=False)["input_ids"]
        if t.startswith(BOS)
        else fast(t)["input_ids"] + [eos_id]
        for t in texts
    ]


def batched(encoded: list[list[int]], pad_id: int) -> list[torch.Tensor]:
    """Batches of similar lengths: little padding to compute."""
    rows = sorted(encoded, key=len)
    return [pad(rows[i : i + 8], pad_id) for i in range(0, len(rows), 8)]


def build_adapter(
    model: LlamaForCausalLM, fast: PreTrainedTokenizerFast, out: Path, base_name: str, steps: int
) -> float:
    """Train rank-8 LoRA weights on the adapter's text (the base frozen) and write them in
    PEFT's layout. Changes `model` in place: call it after the base model is saved."""
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    wrapped: dict[str, LoraLinear] = {}
    for i, layer in enumerate(model.model.layers):
        attention = layer.self_attn
        for target in LORA_TARGETS:
            lora = LoraLinear(getattr(attention, target), LORA_RANK, LORA_ALPHA)
            setattr(attention, target, lora)
            wrapped[f"base_model.model.model.layers.{i}.self_attn.{target}"] = lora
    texts = [*ADAPTER_TEXT.splitlines(), *(chat_text(*d) for d in ADAPTER_DIALOGUES)]
    batches = batched(encode(fast, texts, model.config.eos_token_id), model.config.pad_token_id)
    trained = [p for m in wrapped.values() for p in (m.lora_a, m.lora_b)]
    loss = train(model, batches, steps, trained, lr=LORA_LR)
    tensors: dict[str, torch.Tensor] = {}
    for prefix, lora in wrapped.items():
        tensors[f"{prefix}.lora_A.weight"] = lora.lora_a.detach().contiguous()
        tensors[f"{prefix}.lora_B.weight"] = lora.lora_b.detach().contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "adapter_model.safetensors", metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_name,
        "r": LORA_RANK,
        "lora_alpha": LORA_ALPHA,
        "lora_dropout": 0.0,
        "target_modules": list(LORA_TARGETS),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "inference_mode": True,
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return loss


def pad(rows: list[list[int]], pad_id: int) -> torch.Tensor:
    width = max(len(row) for row in rows)
    return torch.tensor([row + [pad_id] * (width - len(row)) for row in rows])


def train(
    model: LlamaForCausalLM,
    batches: list[torch.Tensor],
    steps: int,
    parameters: list[torch.nn.Parameter] | None = None,
    lr: float = 3e-3,
) -> float:
    """Fit the corpus closely: greedy output then stays on it, whatever the prompt."""
    optimizer = torch.optim.AdamW(model.parameters() if parameters is None else parameters, lr=lr)
    loss = torch.tensor(0.0)
    model.train()
    for step in range(steps):
        ids = batches[step % len(batches)]
        mask = ids != model.config.pad_token_id
        labels = ids.masked_fill(~mask, -100)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    return float(loss.detach())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--adapter-steps", type=int, default=200)
    parser.add_argument("--name", default="narwhal-tiny", help="the adapter's base model")
    args = parser.parse_args()
    started = time.monotonic()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # one reduction order, so the weights repeat bit for bit
    torch.use_deterministic_algorithms(True)

    texts = corpus()
    tokenizer = build_tokenizer(texts)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        chat_template=CHAT_TEMPLATE,
        model_max_length=2048,
    )
    config = LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.token_to_id(BOS),
        eos_token_id=tokenizer.token_to_id(EOS),
        pad_token_id=tokenizer.token_to_id(PAD),
        tie_word_embeddings=False,
        dtype="float32",
    )
    model = LlamaForCausalLM(config)

    batches = batched(encode(fast, texts, config.eos_token_id), config.pad_token_id)
    loss = train(model, batches, args.steps)

    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    fast.save_pretrained(args.out)
    torch.manual_seed(args.seed + 1)
    adapter_loss = build_adapter(model, fast, args.out / "lora", args.name, args.adapter_steps)
    summary = {
        "seed": args.seed,
        "vocab": config.vocab_size,
        "parameters": sum(p.numel() for p in model.parameters()),
        "final_loss": round(loss, 4),
        "adapter_final_loss": round(adapter_loss, 4),
        "seconds": round(time.monotonic() - started, 1),
    }
    (args.out / ".built").write_text(json.dumps(summary) + "\n")
    print(f"tiny model in {args.out}: {json.dumps(summary)}")


if __name__ == "__main__":
    main()
