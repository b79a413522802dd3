"""What an engine says about itself: `/v1/models`, `/sim/identity`, `system_fingerprint`.

Pure: JSON values from the options and the running launch's identity, shaped as vLLM 0.32
shapes them, so the router's contract checks read a simulated engine as a real one.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from collections.abc import Iterable

from narwhal.tools.sim.lora import Adapter
from narwhal.tools.sim.options import SimOptions


def fingerprint(options: SimOptions) -> str:
    """`system_fingerprint`, shaped as vLLM 0.32's default: version and a config hash."""
    config = f"{options.model}|{options.kv_block_size}|{options.tp_size}|{options.device}"
    digest = hashlib.blake2b(config.encode(), digest_size=4).hexdigest()
    return f"vllm-{options.version}-{digest}"


def models(
    options: SimOptions, adapters: Iterable[Adapter], now: float | None = None
) -> dict[str, object]:
    """The `/v1/models` listing as vLLM 0.32 builds it: the base model's card, then one
    per loaded adapter (its path as `root`, the base as `parent`, no `max_model_len`).
    Each card and permission is made for the listing: `created` is now, and the
    permission id fresh."""
    created = int(time.time() if now is None else now)
    base = _card(options.model, created, options.model, None, options.max_model_len)
    cards = [_card(a.name, created, a.path, options.model, None) for a in adapters]
    return {"object": "list", "data": [base, *cards]}


def _card(
    name: str, created: int, root: str, parent: str | None, max_model_len: int | None
) -> dict[str, object]:
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "vllm",
        "root": root,
        "parent": parent,
        "max_model_len": max_model_len,
        "permission": [
            {
                "id": f"modelperm-{secrets.randbits(64):016x}",
                "object": "model_permission",
                "created": created,
                "allow_create_engine": False,
                "allow_sampling": True,
                "allow_logprobs": True,
                "allow_search_indices": False,
                "allow_view": True,
                "allow_fine_tuning": False,
                "organization": "*",
                "group": None,
                "is_blocking": False,
            }
        ],
    }


def identity(
    options: SimOptions, engine_id: str, adapters: Iterable[Adapter] = ()
) -> dict[str, object]:
    """`/sim/identity`: the contract fields a router pins, and the adapters served now."""
    return {
        "engine_version": options.version,
        "model": options.model,
        "lora_adapters": {adapter.name: adapter.path for adapter in adapters},
        "runtime_lora_updating": options.runtime_lora_updating,
        "connector": "NixlConnector",
        "block_size": options.kv_block_size,
        "tp_size": options.tp_size,
        "engine_id": engine_id,
    }
