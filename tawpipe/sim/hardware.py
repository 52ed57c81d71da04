"""What the simulator runs on: devices, links and the cluster they form (design §9.2).

Rates are *achieved* rates, not datasheet peaks: a device's dense-matmul and attention FLOP/s
as a training step reaches them, a link's bytes per second per direction times an efficiency
that TCP or NCCL reaches on it. The presets state their basis; ``tawpipe simulate --calibrate``
measures the current device instead.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from .network import Fabric

GiB = 2**30


@dataclass(frozen=True)
class Device:
    """One accelerator (or one emulated rank: a CPU quota)."""

    name: str
    matmul_flops: float  # achieved FLOP/s of the linear layers, in the compute dtype
    attention_flops: float  # achieved FLOP/s of the attention score and value products
    memory_bandwidth: float  # bytes/s: optimizer steps, casts, the embedding
    memory: float  # bytes a rank may use
    peak: float | None = None  # datasheet FLOP/s in the compute dtype, for MFU (None: the matmul rate)
    # an emulated rank's: bytes/s its CPU moves through gloo (sends plus receives) with nothing else
    # to do, which its compute then lacks; None: transfers cost the device no compute (DMA, NICs)
    transfer_rate: float | None = None
    # an emulated rank under a CPU quota (design §9.2): seconds of a wait it gets back at most, by
    # computing at ``burst`` times its sustained speed once it runs again; and the machine's cores
    # in ranks' sustained compute (cores / quota), which ranks that burst at once share
    idle_credit: float | None = None
    burst: float | None = None
    host_ranks: float | None = None

    def __post_init__(self) -> None:
        optional = (self.transfer_rate, self.idle_credit, self.burst, self.host_ranks)
        if min(self.matmul_flops, self.attention_flops, self.memory_bandwidth, self.memory,
               *(1.0 if v is None else v for v in optional)) <= 0:
            raise ValueError(f"device {self.name!r}: every rate and the memory must be positive")

    @property
    def peak_flops(self) -> float:
        return self.peak or self.matmul_flops


@dataclass(frozen=True)
class Link:
    """One direction of a full-duplex link: ``rate`` bytes/s nominal, ``efficiency`` of it reached
    by bulk transfers, ``latency`` seconds per hop (a message or a step of a collective). A shaped
    link (the emulated cluster's) also has a ``burst``."""

    name: str
    rate: float
    latency: float
    efficiency: float = 1.0
    burst: float = 0.0  # bytes a shaper lets through at once after an idle spell (tc htb's burst)

    def __post_init__(self) -> None:
        if self.rate <= 0 or self.latency < 0 or not 0 < self.efficiency <= 1:
            raise ValueError(f"link {self.name!r}: needs rate > 0, latency >= 0, 0 < efficiency <= 1")

    @property
    def bandwidth(self) -> float:
        """What bulk transfers reach, bytes/s."""
        return self.rate * self.efficiency


# Basis: H100 SXM 989 TFLOP/s dense bf16 at 45% achieved in training (MFU of well-tuned LLaMA
# runs); attention kernels (FlashAttention-2/3) reach about 40% of peak forward+backward; HBM3
# 3.35 TB/s at 80%. A100 SXM: 312 TFLOP/s at 50%, 2.0 TB/s at 80%. Memory: 80 GB each.
DEVICES: dict[str, Device] = {
    "h100": Device("h100", 0.45 * 989e12, 0.40 * 989e12, 0.8 * 3.35e12, 80e9, 989e12),
    "a100": Device("a100", 0.50 * 312e12, 0.40 * 312e12, 0.8 * 2.0e12, 80e9, 312e12),
}

# Basis: NVLink 4 (H100 SXM) 450 GB/s per direction, NCCL bus bandwidth about 80% of it; PCIe 4
# x16 32 GB/s at 80%; TCP over Ethernet about 90% of line rate with 50 us per message; RDMA
# (InfiniBand / RoCE NICs) 95% with 5 us.
LINKS: dict[str, Link] = {
    "nvlink": Link("nvlink", 450e9, 3e-6, 0.8),
    "pcie": Link("pcie", 32e9, 5e-6, 0.8),
    "10gbe": Link("10gbe", 10e9 / 8, 50e-6, 0.9),
    "25gbe": Link("25gbe", 25e9 / 8, 50e-6, 0.9),
    "100gb": Link("100gb", 100e9 / 8, 5e-6, 0.95),
    "400gb": Link("400gb", 400e9 / 8, 5e-6, 0.95),
}



@dataclass(frozen=True)
class Host:
    """A node's host, as the memory savers use it: ``memory`` bytes of host memory per node (what
    every rank's offloaded bytes must fit in together), ``pcie`` one device's link to it (each
    device its own x16 link, full duplex; ``pcie_d2h`` the device-to-host direction's where it
    differs), and ``adamw_bandwidth`` the bytes/s of memory traffic a fused CPU AdamW reaches over
    the node's cores (``ADAMW_BYTES`` per parameter), which the node's ranks share."""

    memory: float
    pcie: Link
    adamw_bandwidth: float
    pcie_d2h: Link | None = None

    def __post_init__(self) -> None:
        if self.memory <= 0 or self.adamw_bandwidth <= 0:
            raise ValueError(f"host: memory and adamw_bandwidth must be positive, got {self}")

    @property
    def to_host(self) -> Link:
        """The device-to-host direction's link."""
        return self.pcie_d2h or self.pcie


# Basis: an 8-GPU H100 node (DGX H100: 2 TB of host memory, one PCIe 5 x16 switch port per GPU,
# reached at about 25 GB/s per direction by pinned copies: the "pcie" link's 32 GB/s at 80%).
# CPU AdamW: torch's fused AdamW stepped 403 M float32 parameters in 0.079 s on 16 threads of the
# H200 machine's host (issue #35), 163 GB/s of AdamW traffic; a node's cores reach at least that.
HOST = Host(memory=2e12, pcie=LINKS["pcie"], adamw_bandwidth=160e9)

_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def link(spec: str | Link) -> Link:
    """A preset name, or a rate such as ``10gbit``, ``14mbit`` or ``25gbps`` (bits per second),
    optionally with ``@latency_us`` and ``*efficiency``: ``14mbit@300*0.97``."""
    if isinstance(spec, Link):
        return spec
    key = spec.lower().strip()
    if key in LINKS:
        return LINKS[key]
    m = re.fullmatch(r"([0-9.]+)\s*([kmgt]?)(?:bit|bps|b)(?:@([0-9.]+))?(?:\*([0-9.]+))?", key)
    if not m:
        raise ValueError(f"link {spec!r}: expected one of {', '.join(LINKS)} or a rate like 10gbit, "
                         f"14mbit@300 (latency in us), 25gbit*0.9 (efficiency)")
    rate = float(m.group(1)) * _UNITS[m.group(2)] / 8
    latency = float(m.group(3)) * 1e-6 if m.group(3) else 50e-6
    return Link(key, rate, latency, float(m.group(4)) if m.group(4) else 1.0)


def device(spec: str | Device) -> Device:
    """A preset name (``h100``, ``a100``), optionally with ``:memory=GiB``."""
    if isinstance(spec, Device):
        return spec
    name, _, opts = spec.lower().partition(":")
    if name not in DEVICES:
        raise ValueError(f"device {spec!r}: expected one of {', '.join(DEVICES)} (or calibrate this machine's "
                         f"with `tawpipe simulate --calibrate`)")
    dev = DEVICES[name]
    for opt in filter(None, opts.split(",")):
        key, _, value = opt.partition("=")
        if key != "memory":
            raise ValueError(f"device {spec!r}: option {key!r} is not known; the one option is memory=GiB, "
                             f"as in {name}:memory=40")
        try:
            gib = float(value)
        except ValueError:
            raise ValueError(f"device {spec!r}: memory={value!r} is not a number of GiB; expected the form "
                             f"{name}:memory=40") from None
        dev = replace(dev, memory=gib * GiB)
    return dev


@dataclass(frozen=True)
class Cluster:
    """``nodes`` nodes of ``per_node`` devices; ``intra`` links the devices of a node (each its own
    port), ``inter`` links nodes (one port per node, or per device with ``rails``); ``host`` is
    each node's host memory and its PCIe links to the devices."""

    nodes: int
    per_node: int
    device: Device
    intra: Link
    inter: Link
    rails: bool = False
    host: Host = HOST

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.per_node < 1:
            raise ValueError(f"a cluster needs nodes >= 1 and per_node >= 1, got {self.nodes} x {self.per_node}")

    @property
    def world_size(self) -> int:
        return self.nodes * self.per_node

    def fabric(self, fold: int | None = None, *, host: bool = False) -> Fabric:
        """The links; ``host``: the ranks are CPU processes whose transfers take their compute, and
        which get part of a wait back (``Device.idle_credit``)."""
        d = self.device
        cpu = d.transfer_rate if host else None
        credit, peak, cores = 0.0, None, None
        if cpu and d.idle_credit and d.burst and d.burst > 1:
            credit, peak = d.idle_credit * cpu, d.burst * cpu
        if cpu and d.host_ranks:
            cores = d.host_ranks / self.world_size * cpu
        return Fabric(self.per_node, self.intra.bandwidth, self.inter.bandwidth, self.rails, fold,
                      burst=self.inter.burst, cpu=cpu, cpu_credit=credit, cpu_peak=peak, cores=cores,
                      pcie=self.host.pcie.bandwidth, pcie_d2h=self.host.to_host.bandwidth)

    def hop_latency(self, crosses_nodes: bool) -> float:
        return self.inter.latency if crosses_nodes else self.intra.latency
