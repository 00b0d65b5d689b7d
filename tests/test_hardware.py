"""The layout lab's hardware profiles: units and the relations between them that the profiles' sources state."""

import pytest

from jaxpar.analysis.hardware import HARDWARE, get_hardware
from jaxpar.analysis.plan import link_of
from jaxpar.rules import LayoutError


@pytest.mark.parametrize("name", sorted(HARDWARE))
def test_profiles_are_per_chip_si_units(name):
    hw = get_hardware(name)
    assert hw.name == name
    assert 1e14 < hw.peak_bf16_flops < 1e16 and 1e10 < hw.hbm_bytes < 1e12 and 5e11 < hw.hbm_bandwidth < 1e13
    assert 1e9 < hw.slow_link <= hw.fast_link < 1e12 and hw.fast_domain >= 8


def test_pcie_cards_against_their_datasheets():
    """H100 PCIe: the same die as the SXM part at lower clocks (756 of 989 dense BF16 TFLOP/s), HBM2e at
    2.0 TB/s; its PCIe Gen5 x16 slot (64 GB/s each way) is 7 times slower than the SXM's NVLink (450 each
    way), the ratio of the datasheets' 900 and 128 GB/s. L40S: PCIe Gen4, half of Gen5's lane rate."""
    sxm, pcie, l40s = HARDWARE["h100"], HARDWARE["h100-pcie"], HARDWARE["l40s"]
    # dense BF16 is half the datasheets' "with sparsity" figures (1,513 and 733 TFLOP/s), to their rounding
    assert pcie.peak_bf16_flops == pytest.approx(1513e12 / 2, rel=1e-3)
    assert l40s.peak_bf16_flops == pytest.approx(733e12 / 2, rel=2e-2)
    assert (pcie.hbm_bytes, pcie.hbm_bandwidth, pcie.fast_link) == (80e9, 2.0e12, 128e9 / 2)
    assert sxm.fast_link / pcie.fast_link == pytest.approx(900 / 128)
    assert (l40s.hbm_bytes, l40s.hbm_bandwidth) == (48e9, 864e9)
    assert l40s.fast_link == pcie.fast_link / 2
    # a tensor group of 8 cards stays on the PCIe link; 16 span two servers and take the NIC
    mesh = dict(stage=1, data=1, fsdp=2, expert=1, sequence=1, tensor=8)
    assert link_of("tensor", mesh, pcie) == ("fast", 64e9)
    assert link_of("fsdp", mesh, l40s) == ("slow", 25e9)


def test_unknown_hardware_names_the_closest():
    with pytest.raises(LayoutError, match="h100-pcie"):
        get_hardware("h100-pci")


def test_tpu7x_against_its_page():
    """Google Cloud's TPU7x page, per chip: 2,307 dense BF16 TFLOP/s, 192 GiB of HBM at 7,380 GB/s, 1,200 GB/s of
    bidirectional ICI (6 links of a 3D torus, so 100 GB/s per link and direction, v5p's) and 100 Gb/s of DCN."""
    hw = HARDWARE["tpu7x"]
    assert (hw.peak_bf16_flops, hw.hbm_bytes, hw.hbm_bandwidth) == (2307e12, 192 * 2**30, 7.38e12)
    assert hw.torus_dims == 3 and 2 * 2 * hw.torus_dims * hw.ici_link == 1200e9 and hw.slow_link * 8 == 100e9
    assert hw.ici_link == HARDWARE["tpu-v5p"].ici_link


def test_device_kinds_name_their_profiles():
    from jaxpar.analysis.hardware import hardware_of_device

    kinds = {
        "NVIDIA H100 80GB HBM3": "h100",
        "NVIDIA H100 PCIe": "h100-pcie",
        "NVIDIA H200": "h200",
        "NVIDIA A100-SXM4-80GB": "a100",
        "NVIDIA L40S": "l40s",
        "TPU v5 lite": "tpu-v5e",
        "TPU v5p": "tpu-v5p",
        "TPU v6 lite": "tpu-v6e",
        "TPU7x": "tpu7x",
        "cpu": None,
        "NVIDIA GH200 480GB": None,
        "NVIDIA H100 NVL": None,
    }
    assert {k: hardware_of_device(k) for k in kinds} == kinds
