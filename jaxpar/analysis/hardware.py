"""Accelerator profiles for the layout lab: peak compute, memory, and the two link classes.

Every value is per chip. ``fast_link`` is the bandwidth one chip sends at, per direction, to peers of its
fast domain (NVLink inside an NVLink domain; the PCIe slot of a card without NVLink, whose server is the
domain; ICI inside a TPU slice); ``slow_link`` is the per-chip bandwidth across domains (InfiniBand/RoCE
between GPU nodes; data-center network between TPU slices).
A mesh axis whose device group fits inside one ``fast_domain`` uses the fast link, otherwise the slow one.

What the mechanism step-time model (``jaxpar.analysis.steptime``) adds: ``family`` (whose calibrated
constants apply), ``torus_dims`` and ``ici_link`` (a TPU slice is a torus; an ICI link's bandwidth per
direction: an axis spanning k torus dimensions sends over 2k of them), ``matmul_tile`` (matmul dimensions
are padded to it: the TPU's 128×128 MXU, a GPU GEMM's 128-wide tiles), ``attention_efficiency`` (a flash
kernel's throughput relative to a large GEMM's) and ``tensor_overlap`` (whether the compiler runs the
backward's tensor-parallel all-reduces beside the weight-gradient matmuls).
"""

from __future__ import annotations

import dataclasses

from jaxpar.errors import LayoutError, suggest


@dataclasses.dataclass(frozen=True)
class Hardware:
    name: str
    peak_bf16_flops: float  # dense bf16 FLOP/s
    hbm_bytes: float  # memory per chip
    hbm_bandwidth: float  # bytes/s
    fast_link: float  # bytes/s per direction per chip inside the fast domain
    fast_domain: int  # chips joined by the fast link
    slow_link: float  # bytes/s per direction per chip across domains
    family: str = "gpu"
    torus_dims: int = 0
    ici_link: float = 0.0
    matmul_tile: int = 128
    attention_efficiency: float = 1.0
    tensor_overlap: bool = False
    peak_fp8_flops: float = 0.0  # dense FP8 FLOP/s where the chip runs FP8 faster than BF16 (0: it does not)
    # a collective's latency beyond its bytes (``links.collective_latency``): a fixed cost and one per step
    # of the ring over the fast link and over the slow one
    collective_base: float = 0.0
    fast_hop: float = 0.0
    slow_hop: float = 0.0

    @property
    def platform(self) -> str:
        """jax's platform name for the chip: ``tpu`` or ``gpu`` (the kernels it can run)."""
        return "tpu" if self.family.startswith("tpu") else "gpu"


# FlashAttention-3 (Shah et al., 2024, figs. 5-6): causal attention forward and backward with head dim 128 at
# 4k-16k tokens runs at roughly 0.75 of what a large bf16 GEMM reaches on an H100 SXM5 (~500-650 against
# ~750-800 TFLOP/s). Applied to every NVIDIA profile here.
GPU_ATTENTION = 0.75
# FlashAttention-2 on the same figures (head dim 128, 16k tokens): 335 TFLOP/s forward (causal), 322 backward,
# 0.42 of that GEMM: the kernel torch's SDPA ran on H100s in 2024 (``Workload.attention_kernel`` "fa2").
FA2_ATTENTION = 0.42

# NCCL's own cost model (NVIDIA/nccl, src/graph/tuning.cc): a ring collective of the low-latency protocol
# costs baseLat 6.6 µs plus, per ring step, 0.6 µs over NVLink, 1.0 µs over PCIe and 2.7 µs over the
# network (hwLat). XLA:GPU's collectives are NCCL's.
NVLINK_LATENCY = dict(collective_base=6.6e-6, fast_hop=0.6e-6, slow_hop=2.7e-6)
PCIE_LATENCY = dict(collective_base=6.6e-6, fast_hop=1.0e-6, slow_hop=2.7e-6)
# ASTRA-sim's TPU validation models an ICI link's latency as 1 µs ("as per TPU research team"); no launch
# cost (the collectives are compiled into the program). No public figure for DCN: left unpriced (0).
ICI_LATENCY = dict(fast_hop=1e-6)

HARDWARE = {
    # NVIDIA H100 SXM5 datasheet: 989 TFLOP/s dense BF16, 80 GB HBM3 at 3.35 TB/s, NVLink 4 900 GB/s
    # (both directions, so 450 GB/s each way) in an 8-GPU HGX node; one 400 Gb/s NDR InfiniBand NIC per GPU.
    # Dense FP8: 1,979 TFLOP/s (the datasheet's 3,958 with sparsity, halved), on H100 SXM and H200 alike.
    "h100": Hardware(
        "h100",
        989e12,
        80e9,
        3.35e12,
        450e9,
        8,
        50e9,
        attention_efficiency=GPU_ATTENTION,
        peak_fp8_flops=1979e12,
        **NVLINK_LATENCY,
    ),
    # NVIDIA H200 SXM datasheet: the H100's compute and NVLink; 141 GB HBM3e at 4.8 TB/s.
    "h200": Hardware(
        "h200",
        989e12,
        141e9,
        4.8e12,
        450e9,
        8,
        50e9,
        attention_efficiency=GPU_ATTENTION,
        peak_fp8_flops=1979e12,
        **NVLINK_LATENCY,
    ),
    # NVIDIA DGX B200 datasheet: 72 PFLOP/s FP8 training for 8 GPUs (2.25 PFLOP/s dense BF16 per GPU),
    # 1,440 GB HBM3e (180 GB per GPU) at 8 TB/s each, NVLink 5 1.8 TB/s (900 GB/s each way), 400 Gb/s IB per GPU.
    "b200": Hardware(
        "b200", 2.25e15, 180e9, 8e12, 900e9, 8, 50e9, attention_efficiency=GPU_ATTENTION, **NVLINK_LATENCY
    ),
    # NVIDIA H100 PCIe product brief and datasheet (PCIe column): 1,513 TFLOP/s BF16 with sparsity (756 dense),
    # 80 GB HBM2e at 2.0 TB/s, PCIe Gen5 x16 128 GB/s (both directions, so 64 GB/s each way): the fast link
    # of a server whose 8 cards talk over PCIe (no NVLink bridges). Across nodes one 200 Gb/s NIC per GPU
    # (25 GB/s; an assumption, not from the datasheet: PCIe servers vary).
    "h100-pcie": Hardware(
        "h100-pcie", 756e12, 80e9, 2.0e12, 64e9, 8, 25e9, attention_efficiency=GPU_ATTENTION, **PCIE_LATENCY
    ),
    # NVIDIA L40S datasheet: 362.05 TFLOP/s BF16 dense (733 with sparsity), 48 GB GDDR6 at 864 GB/s, PCIe
    # Gen4 x16 64 GB/s bidirectional (32 GB/s each way), no NVLink; 8 cards a server. Across nodes one
    # 200 Gb/s NIC per GPU (25 GB/s; an assumption, as for h100-pcie).
    "l40s": Hardware("l40s", 362.05e12, 48e9, 864e9, 32e9, 8, 25e9, attention_efficiency=GPU_ATTENTION, **PCIE_LATENCY),
    # Google Cloud TPU v5e docs: 197 TFLOP/s BF16, 16 GB HBM2 at 819 GB/s, 1,600 Gbps ICI per chip over
    # 4 links (45-50 GB/s per link and direction), 256-chip pods; DCN about 25 Gbps per chip (estimate).
    # An ICI link: 1,600 Gbps per chip in one direction over 4 links = 50 GB/s; a 16×16 2D torus.
    "tpu-v5e": Hardware(
        "tpu-v5e",
        197e12,
        16e9,
        819e9,
        45e9,
        256,
        3.1e9,
        family="tpu",
        torus_dims=2,
        ici_link=50e9,
        tensor_overlap=True,
        **ICI_LATENCY,
    ),
    # Google Cloud TPU v5p docs: 459 TFLOP/s BF16, 95 GB HBM2e at 2,765 GB/s, 4,800 Gbps ICI per chip over
    # 6 links (about 90-100 GB/s per link), 3D torus slices up to 8,960 chips; DCN 50 Gbps per chip (estimate).
    # The v5p page's table: 1,200 GB/s bidirectional ICI per chip over 6 links = 100 GB/s per link and
    # direction; DCN 50 Gbps per chip; slices 4×4×4 (64 chips), 4×4×8, 4×8×8, 8×8×8, 8×8×16, 8×16×16.
    "tpu-v5p": Hardware(
        "tpu-v5p",
        459e12,
        95e9,
        2.765e12,
        90e9,
        8960,
        6.25e9,
        family="tpu",
        torus_dims=3,
        ici_link=100e9,
        tensor_overlap=True,
        **ICI_LATENCY,
    ),
    # Google Cloud TPU v6e (Trillium) docs: 918 TFLOP/s BF16, 32 GB HBM at 1,640 GB/s, 3,584 Gbps ICI per
    # chip over 4 links (about 90-112 GB/s per link), 256-chip pods; DCN about 50 Gbps per chip (estimate).
    # Trillium doubled the MXU to 256×256 (Google's Trillium announcement, 2024): matmuls pad to 256. A family
    # of its own for calibration: MaxText's v6e recipes reach a smaller share of its peak than v5e/v5p runs.
    "tpu-v6e": Hardware(
        "tpu-v6e",
        918e12,
        32e9,
        1.64e12,
        90e9,
        256,
        6.25e9,
        family="tpu-v6e",
        torus_dims=2,
        ici_link=112e9,
        matmul_tile=256,
        tensor_overlap=True,
        **ICI_LATENCY,
    ),
    # Google Cloud TPU7x (Ironwood) page: 2,307 TFLOP/s BF16 (4,614 FP8) per chip, 192 GiB HBM at 7,380 GB/s, 1,200 GB/s
    # bidirectional ICI per chip (v5p's: 6 links, 100 GB/s per link and direction, a 3D torus of 4×4×4
    # cubes), DCN 100 Gb/s per chip. A chip is two chiplets that JAX sees as two devices: the profile
    # is per chip, so layouts and batches are counted in chips (2 devices each). The page gives no MXU
    # size: Trillium's 256 is assumed (the published shapes are multiples of 256 either way). A
    # calibration family of its own.
    "tpu7x": Hardware(
        "tpu7x",
        2307e12,
        192 * 2**30,
        7.38e12,
        100e9,
        9216,
        12.5e9,
        family="tpu7x",
        torus_dims=3,
        ici_link=100e9,
        matmul_tile=256,
        tensor_overlap=True,
        peak_fp8_flops=4614e12,
        **ICI_LATENCY,
    ),
    # NVIDIA A100 SXM4 80 GB datasheet: 312 TFLOP/s dense BF16/FP16, 2,039 GB/s HBM2e, NVLink 3 600 GB/s (300 GB/s
    # each way) in an 8-GPU DGX A100 node with eight 200 Gb/s HDR InfiniBand NICs (25 GB/s per GPU): NVIDIA's
    # Selene, where Megatron-LM's 2021 runs were measured (Narayanan et al., SC21, §5). A chip of its own
    # family for calibration (its GEMMs reach a larger share of peak than the H100's). FlashAttention-2 (Dao,
    # 2023, fig. 4) runs causal forward + backward at roughly 0.8 of what a large GEMM reaches on it.
    "a100": Hardware(
        "a100", 312e12, 80e9, 2.039e12, 300e9, 8, 25e9, family="a100", attention_efficiency=0.8, **NVLINK_LATENCY
    ),
    # Published runs' machines (``benchmarks/published_runs.json``):
    # Google Cloud A3 (a3-highgpu-8g): 8 × H100 SXM5 80 GB on NVLink 4; GPUDirect-TCPX over 4 NICs of
    # 200 Gbps for the 8 GPUs, so 100 Gbps (12.5 GB/s) per GPU across nodes.
    "h100-a3": Hardware(
        "h100-a3", 989e12, 80e9, 3.35e12, 450e9, 8, 12.5e9, attention_efficiency=GPU_ATTENTION, **NVLINK_LATENCY
    ),
    # Meta's Grand Teton, as torchtitan's benchmarks/llama3_h100_202412_torchtitan.md describes it: H100 with
    # 96 GB HBM2e at 2.4 TB/s, NVLink inside the 8-GPU host, 400 Gb/s RDMA per GPU, 500 W power limit (its
    # real peak lies between the SXM's 989 and the NVL's 835 TFLOP/s, the page says: the midpoint, 912; FP8
    # likewise between the SXM's 1,979 and the NVL's 1,670.5 (its datasheet's 3,341 with sparsity, halved)).
    "h100-gt": Hardware(
        "h100-gt",
        912e12,
        96e9,
        2.4e12,
        450e9,
        8,
        50e9,
        attention_efficiency=GPU_ATTENTION,
        peak_fp8_flops=1825e12,
        **NVLINK_LATENCY,
    ),
}


def get_hardware(name: str, /) -> Hardware:
    if name not in HARDWARE:
        raise LayoutError(
            f"--hardware: unknown hardware {name!r}{suggest(name, HARDWARE)}; known: {', '.join(HARDWARE)}"
        )
    return HARDWARE[name]


# JAX's ``device_kind`` strings, most specific first: "NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe",
# "NVIDIA H200", "NVIDIA A100-SXM4-80GB", "TPU v5 lite", "TPU v5p", "TPU v6 lite", "TPU7x".
_DEVICE_KINDS = (
    ("gh200", None),
    ("h100nvl", None),
    ("h100pcie", "h100-pcie"),
    ("h100", "h100"),
    ("h200", "h200"),
    ("b200", "b200"),
    ("l40s", "l40s"),
    ("a100", "a100"),
    ("tpuv5lite", "tpu-v5e"),
    ("tpuv5e", "tpu-v5e"),
    ("tpuv5p", "tpu-v5p"),
    ("tpuv6lite", "tpu-v6e"),
    ("tpuv6e", "tpu-v6e"),
    ("tpu7x", "tpu7x"),
)


def hardware_of_device(device_kind: str, /) -> str | None:
    """The profile name for a JAX ``device_kind`` (a datasheet chip: SXM for H100/H200/A100), or None
    (GH200 and H100 NVL have other memories and clocks: no profile)."""
    key = device_kind.lower().replace(" ", "").replace("-", "")
    return next((name for pattern, name in _DEVICE_KINDS if pattern in key), None)
