"""What an engine says about itself: `/v1/models`, `/sim/identity`, `system_fingerprint`.

Pure: JSON values from the options and the running launch's identity, shaped as vLLM 0.32
shapes them, so the router's contract checks read a simulated engine as a real one.
"""

from __future__ import annotations

import hashlib

from narwhal.tools.sim.options import SimOptions


def fingerprint(options: SimOptions) -> str:
    """`system_fingerprint`, shaped as vLLM 0.32's default: version and a config hash."""
    config = f"{options.model}|{options.kv_block_size}|{options.tp_size}|{options.device}"
    digest = hashlib.blake2b(config.encode(), digest_size=4).hexdigest()
    return f"vllm-{options.version}-{digest}"


def models(options: SimOptions, engine_id: str, start_time: float) -> dict[str, object]:
    """The `/v1/models` listing: the one served model."""
    model = {
        "id": options.model,
        "object": "model",
        "created": int(start_time),
        "owned_by": "vllm",
        "root": options.model,
        "parent": None,
        "max_model_len": options.max_model_len,
        "permission": [
            {
                "id": f"modelperm-{engine_id[:16]}",
                "object": "model_permission",
                "created": int(start_time),
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
    return {"object": "list", "data": [model]}


def identity(options: SimOptions, engine_id: str) -> dict[str, object]:
    """`/sim/identity`: the contract fields a router pins."""
    return {
        "engine_version": options.version,
        "model": options.model,
        "connector": "NixlConnector",
        "block_size": options.kv_block_size,
        "tp_size": options.tp_size,
        "engine_id": engine_id,
    }
