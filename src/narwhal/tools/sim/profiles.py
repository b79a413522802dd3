"""Preset engine profiles for `narwhal sim --profile`: a model on a GPU, as step costs.

GPU profiles are derived here from a model's shape and a GPU's data sheet, with the
efficiencies stated beside them, so the arithmetic can be read and tested; the derivation
and its sources are in docs/simulator-timing.md. `dev` is the simulator's historical fast
default (no overrides), which keeps the test suite and `make run` quick.
"""

from __future__ import annotations

from dataclasses import dataclass

ProfileValues = dict[str, float | int]

# Fields a profile may set; every one also has its own `narwhal sim` flag.
PROFILE_FIELDS = (
    "request_overhead_s",
    "step_overhead_s",
    "prefill_s_per_token",
    "inter_token_s",
    "slowdown_per_seq",
    "kv_read_s_per_token",
    "max_num_batched_tokens",
    "max_num_seqs",
    "num_kv_blocks",
    "tp_size",
    "kv_bytes_per_token",
    "kv_pull_latency_s",
    "kv_pull_s_per_block",
    "kv_pull_bytes_per_s",
)


@dataclass(frozen=True, slots=True)
class Model:
    """A dense decoder's shape: what sets its FLOPs per token and KV bytes per token."""

    params: float
    layers: int
    kv_heads: int
    head_dim: int
    bytes_per_param: int = 2  # BF16

    @property
    def weight_bytes(self) -> float:
        return self.params * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V, every layer, every KV head (BF16 cache)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.bytes_per_param


@dataclass(frozen=True, slots=True)
class Gpu:
    """Data-sheet peaks of one GPU and its network link for KV transfers."""

    dense_bf16_flops: float
    hbm_bytes_per_s: float
    memory_bytes: float
    nic_bytes_per_s: float


@dataclass(frozen=True, slots=True)
class Efficiency:
    """What share of the peaks a serving engine reaches (assumptions, documented)."""

    bandwidth: float = 0.75  # decode reaches ~75-80% of HBM bandwidth
    prefill_mfu: float = 0.5  # prefill reaches ~50% of dense peak FLOPs
    nic: float = 0.8
    gpu_memory_utilization: float = 0.9  # vLLM's default
    activation_bytes_per_gpu: float = 4e9  # activations, CUDA graphs, workspace


LLAMA_3_1_8B = Model(params=8.03e9, layers=32, kv_heads=8, head_dim=128)
LLAMA_3_1_70B = Model(params=70.6e9, layers=80, kv_heads=8, head_dim=128)
# H100 SXM5 80 GB: 989 TFLOPS dense BF16, 3.35 TB/s HBM3, one 400 Gb/s NIC per GPU.
H100_SXM = Gpu(
    dense_bf16_flops=989e12, hbm_bytes_per_s=3.35e12, memory_bytes=80e9, nic_bytes_per_s=50e9
)


def derive(
    model: Model,
    gpu: Gpu,
    *,
    tp: int = 1,
    efficiency: Efficiency = Efficiency(),
    step_overhead_s: float,
    request_overhead_s: float,
    kv_pull_latency_s: float,
    block_size: int = 16,
) -> ProfileValues:
    """Step costs of `model` served on `tp` GPUs, from first principles.

    A decode step reads every weight once (split over `tp` GPUs), so its floor is weight
    bytes over effective bandwidth; each sequence adds its forward FLOPs (~2 * params) and
    each context token its KV bytes. A prompt token costs its forward FLOPs at the
    prefill MFU. The KV pool is what is left of GPU memory after weights and activations.
    """
    flops = tp * gpu.dense_bf16_flops
    bandwidth = tp * gpu.hbm_bytes_per_s * efficiency.bandwidth
    forward_flops = 2 * model.params
    weights_s = model.weight_bytes / bandwidth
    prefill_s = forward_flops / (flops * efficiency.prefill_mfu)
    kv_pool = (
        tp * (gpu.memory_bytes * efficiency.gpu_memory_utilization)
        - model.weight_bytes
        - tp * efficiency.activation_bytes_per_gpu
    )
    return {
        "request_overhead_s": request_overhead_s,
        "step_overhead_s": step_overhead_s,
        "prefill_s_per_token": prefill_s,
        "inter_token_s": weights_s,
        # Per extra sequence: its forward FLOPs, as a share of the weight-read floor.
        "slowdown_per_seq": prefill_s / weights_s,
        "kv_read_s_per_token": model.kv_bytes_per_token / bandwidth,
        "max_num_batched_tokens": 8192,
        "max_num_seqs": 256,
        "num_kv_blocks": int(kv_pool // (model.kv_bytes_per_token * block_size)),
        "tp_size": tp,
        "kv_bytes_per_token": model.kv_bytes_per_token,
        "kv_pull_latency_s": kv_pull_latency_s,
        "kv_pull_s_per_block": 0.0,
        # Each of the tp GPUs pulls its shard of the KV over its own NIC.
        "kv_pull_bytes_per_s": tp * gpu.nic_bytes_per_s * efficiency.nic,
    }


PROFILES: dict[str, ProfileValues] = {
    "dev": {},
    "llama-3.1-8b-h100": derive(
        LLAMA_3_1_8B,
        H100_SXM,
        step_overhead_s=0.0005,
        request_overhead_s=0.002,
        kv_pull_latency_s=0.002,
    ),
    "llama-3.1-70b-h100-tp4": derive(
        LLAMA_3_1_70B,
        H100_SXM,
        tp=4,
        # Two all-reduces per layer over NVLink, ~15 us each at decode batch sizes.
        step_overhead_s=0.0005 + 2 * 80 * 15e-6,
        request_overhead_s=0.002,
        kv_pull_latency_s=0.002,
        efficiency=Efficiency(prefill_mfu=0.45),
    ),
}


def profile(name: str) -> ProfileValues:
    """A preset's field values; raises ValueError naming the presets for an unknown one."""
    try:
        return dict(PROFILES[name])
    except KeyError:
        raise ValueError(
            f"unknown profile {name!r}; presets: {', '.join(sorted(PROFILES))}"
        ) from None
