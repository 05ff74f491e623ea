"""Per-GPU figures for the planner's roofline.

The dense tensor-core peaks come from
:func:`titanext.components.metrics.peak_flops_for_name` (the same table the trainer's MFU
uses), so the two never disagree. Memory, HBM bandwidth and link bandwidths are vendor
datasheet figures per GPU and per direction: NVLink inside a node, the
GPU's network card (InfiniBand / RoCE) between nodes. Latencies are per collective step,
typical of NCCL rings on these fabrics.

>>> DEVICES["h100"].bf16_flops / 1e12, DEVICES["h100"].fp8_flops / 1e12
(989.4, 1978.8)
>>> DEVICES["h800"].bf16_flops == DEVICES["h100"].bf16_flops, DEVICES["h800"].intra_bw / 1e9
(True, 200.0)
>>> with_overrides(DEVICES["h100"], inter_gbps=100).inter_bw / 1e9
100.0
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from titanext.components.metrics import peak_flops_for_name

GB = 1e9


@dataclass(frozen=True)
class Device:
    """One GPU: dense bf16 (and float8, 0 = none) FLOP/s, HBM bytes and bytes/s, link bytes/s
    per direction inside a node (NVLink) and between nodes (network card), and the latency of
    one collective step on each."""

    name: str
    bf16_flops: float
    fp8_flops: float
    hbm_bytes: float
    hbm_bw: float
    intra_bw: float
    inter_bw: float
    intra_latency: float = 10e-6
    inter_latency: float = 25e-6
    sms: int = 132  # streaming multiprocessors (the --comm-sms charge is a share of them)


def _device(name: str, datasheet_name: str, hbm_gb: float, hbm_tbps: float, intra_gbps: float,
            inter_gbps: float, sms: int) -> Device:
    bf16 = peak_flops_for_name(datasheet_name, torch.bfloat16)
    fp8 = peak_flops_for_name(datasheet_name, torch.float8_e4m3fn) or 0.0
    assert bf16 is not None, datasheet_name  # the metrics table knows every device listed here
    return Device(name, bf16, fp8, hbm_gb * GB, hbm_tbps * 1e12, intra_gbps * GB, inter_gbps * GB,
                  sms=sms)


#: SMs charged to communication while it overlaps compute (``titanext-plan --comm-sms``): the
#: DeepSeek-V3 report dedicates 20 of the H800's 132 SMs to its all-to-all and pipeline
#: traffic while DualPipe overlaps them with compute. The same 20 on the H100 (132 SMs too) is
#: an assumption: its NVLink is 2.25x the H800's, so the intra-node forwarding may need fewer.
COMM_SMS = 20


# NVLink 4 (H100/H200) moves 900 GB/s in both directions together, NVLink 3 600, NVLink 5 1800;
# one 400 Gb/s NIC per GPU is 50 GB/s (A100 systems: 200 Gb/s, 25 GB/s). The H800 (DeepSeek-V3's
# GPU) computes as the H100 SXM with NVLink cut to 400 GB/s both ways together (200 each way)
# and one 400 Gb/s InfiniBand NIC per GPU. SMs: 132 on the SXM Hoppers, 108 on the A100, 148
# on the B200.
DEVICES: dict[str, Device] = {
    "h100": _device("H100 SXM", "NVIDIA H100 80GB HBM3", 80, 3.35, 450, 50, 132),
    "h200": _device("H200 SXM", "NVIDIA H200", 141, 4.8, 450, 50, 132),
    "h800": _device("H800 SXM", "NVIDIA H800", 80, 3.35, 200, 50, 132),
    "a100": _device("A100 SXM 80GB", "NVIDIA A100-SXM4-80GB", 80, 2.039, 300, 25, 108),
    "b200": _device("B200", "NVIDIA B200", 180, 8.0, 900, 50, 148),
}


def with_overrides(device: Device, *, peak_tflops: float | None = None,
                   fp8_tflops: float | None = None, hbm_gb: float | None = None,
                   hbm_tbps: float | None = None, intra_gbps: float | None = None,
                   inter_gbps: float | None = None) -> Device:
    """``device`` with any of its figures replaced (None keeps the table's)."""
    changes = {"bf16_flops": peak_tflops and peak_tflops * 1e12,
               "fp8_flops": fp8_tflops and fp8_tflops * 1e12,
               "hbm_bytes": hbm_gb and hbm_gb * GB, "hbm_bw": hbm_tbps and hbm_tbps * 1e12,
               "intra_bw": intra_gbps and intra_gbps * GB,
               "inter_bw": inter_gbps and inter_gbps * GB}
    return dataclasses.replace(device, **{k: v for k, v in changes.items() if v})
