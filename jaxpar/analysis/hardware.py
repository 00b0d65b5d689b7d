"""Accelerator profiles for the layout lab: peak compute, memory, and the two link classes.

Every value is per chip. ``fast_link`` is the bandwidth one chip sends at, per direction, to peers of its
fast domain (NVLink inside an NVLink domain; the PCIe slot of a card without NVLink, whose server is the
domain; ICI inside a TPU slice); ``slow_link`` is the per-chip bandwidth across domains (InfiniBand/RoCE
between GPU nodes; data-center network between TPU slices).
A mesh axis whose device group fits inside one ``fast_domain`` uses the fast link, otherwise the slow one.
"""
from __future__ import annotations

import dataclasses

from jaxpar.rules import LayoutError


@dataclasses.dataclass(frozen=True)
class Hardware:
    name: str
    peak_bf16_flops: float       # dense bf16 FLOP/s
    hbm_bytes: float             # memory per chip
    hbm_bandwidth: float         # bytes/s
    fast_link: float             # bytes/s per direction per chip inside the fast domain
    fast_domain: int             # chips joined by the fast link
    slow_link: float             # bytes/s per direction per chip across domains


HARDWARE = {
    # NVIDIA H100 SXM5 datasheet: 989 TFLOP/s dense BF16, 80 GB HBM3 at 3.35 TB/s, NVLink 4 900 GB/s
    # (both directions, so 450 GB/s each way) in an 8-GPU HGX node; one 400 Gb/s NDR InfiniBand NIC per GPU.
    "h100": Hardware("h100", 989e12, 80e9, 3.35e12, 450e9, 8, 50e9),
    # NVIDIA H200 SXM datasheet: the H100's compute and NVLink; 141 GB HBM3e at 4.8 TB/s.
    "h200": Hardware("h200", 989e12, 141e9, 4.8e12, 450e9, 8, 50e9),
    # NVIDIA DGX B200 datasheet: 72 PFLOP/s FP8 training for 8 GPUs (2.25 PFLOP/s dense BF16 per GPU),
    # 1,440 GB HBM3e (180 GB per GPU) at 8 TB/s each, NVLink 5 1.8 TB/s (900 GB/s each way), 400 Gb/s IB per GPU.
    "b200": Hardware("b200", 2.25e15, 180e9, 8e12, 900e9, 8, 50e9),
    # NVIDIA H100 PCIe product brief and datasheet (PCIe column): 1,513 TFLOP/s BF16 with sparsity (756 dense),
    # 80 GB HBM2e at 2.0 TB/s, PCIe Gen5 x16 128 GB/s (both directions, so 64 GB/s each way): the fast link
    # of a server whose 8 cards talk over PCIe (no NVLink bridges). Across nodes one 200 Gb/s NIC per GPU
    # (25 GB/s; an assumption, not from the datasheet: PCIe servers vary).
    "h100-pcie": Hardware("h100-pcie", 756e12, 80e9, 2.0e12, 64e9, 8, 25e9),
    # NVIDIA L40S datasheet: 362.05 TFLOP/s BF16 dense (733 with sparsity), 48 GB GDDR6 at 864 GB/s, PCIe
    # Gen4 x16 64 GB/s bidirectional (32 GB/s each way), no NVLink; 8 cards a server. Across nodes one
    # 200 Gb/s NIC per GPU (25 GB/s; an assumption, as for h100-pcie).
    "l40s": Hardware("l40s", 362.05e12, 48e9, 864e9, 32e9, 8, 25e9),
    # Google Cloud TPU v5e docs: 197 TFLOP/s BF16, 16 GB HBM2 at 819 GB/s, 1,600 Gbps ICI per chip over
    # 4 links (45-50 GB/s per link and direction), 256-chip pods; DCN about 25 Gbps per chip (estimate).
    "tpu-v5e": Hardware("tpu-v5e", 197e12, 16e9, 819e9, 45e9, 256, 3.1e9),
    # Google Cloud TPU v5p docs: 459 TFLOP/s BF16, 95 GB HBM2e at 2,765 GB/s, 4,800 Gbps ICI per chip over
    # 6 links (about 90-100 GB/s per link), 3D torus slices up to 8,960 chips; DCN 50 Gbps per chip (estimate).
    "tpu-v5p": Hardware("tpu-v5p", 459e12, 95e9, 2.765e12, 90e9, 8960, 6.25e9),
    # Google Cloud TPU v6e (Trillium) docs: 918 TFLOP/s BF16, 32 GB HBM at 1,640 GB/s, 3,584 Gbps ICI per
    # chip over 4 links (about 90-112 GB/s per link), 256-chip pods; DCN about 50 Gbps per chip (estimate).
    "tpu-v6e": Hardware("tpu-v6e", 918e12, 32e9, 1.64e12, 90e9, 256, 6.25e9),
}


def get_hardware(name: str, /) -> Hardware:
    from jaxpar.mesh import suggest

    if name not in HARDWARE:
        raise LayoutError(f"--hardware: unknown hardware {name!r}{suggest(name, HARDWARE)}; known: "
                          f"{', '.join(HARDWARE)}")
    return HARDWARE[name]
