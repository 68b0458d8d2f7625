"""Where bfloat16 pays: what `auto` stands for in [sampler] dtype and [trainer] autocast_bfloat16.

A GPU computes bfloat16 natively, and so does a CPU with AVX512-BF16 or AMX (x86) or the BF16 extension (Arm).
Any other CPU has torch emulate it: a matrix product then runs tens of times slower than in float32 (0.9 against
81 GFLOP/s on a 2-core AVX2 machine), so `auto` is bfloat16 only where the processor has it. Torch is imported
only when a CPU's answer is asked for, so that reading settings stays cheap."""

from __future__ import annotations

import platform
import time
from dataclasses import dataclass
from functools import lru_cache


@dataclass(frozen=True)
class Processor:
    capability: str  # torch.backends.cpu.get_cpu_capability(): AVX512, AVX2, DEFAULT, SVE256, ZVECTOR, ...
    avx512_bf16: bool  # x86: AVX512-BF16 instructions
    amx: bool  # x86: AMX tiles, matrix units that multiply bfloat16
    arm_bf16: bool  # Arm: the BF16 extension (oneDNN's bfloat16 kernels run natively)

    @property
    def native_bfloat16(self) -> bool:
        """Whether torch runs bfloat16 matrix products natively here. On x86 that takes torch's AVX512 kernels
        (ATEN_CPU_CAPABILITY=avx2 withdraws them) on a CPU with AVX512-BF16 or AMX; AVX512 alone emulates."""
        if self.arm_bf16:
            return True
        return self.capability == "AVX512" and (self.avx512_bf16 or self.amx)

    def describe(self) -> str:
        """'this CPU (AVX2) has no native bfloat16', or what gives it bfloat16."""
        if not self.native_bfloat16:
            return f"this CPU ({self.capability}) has no native bfloat16"
        flags = (("AVX512-BF16", self.avx512_bf16), ("AMX", self.amx), ("BF16", self.arm_bf16))
        features = [name for name, has in flags if has]
        return f"this CPU ({self.capability}, {' and '.join(features)}) computes bfloat16 natively"


@lru_cache(maxsize=1)
def this_processor() -> Processor:
    """What torch reports of this machine's CPU."""
    import torch

    arm = platform.machine().lower() in ("aarch64", "arm64")
    return Processor(
        capability=torch.backends.cpu.get_cpu_capability(),
        avx512_bf16=not arm and torch.cpu._is_avx512_bf16_supported(),
        amx=not arm and torch.cpu._is_amx_tile_supported(),
        arm_bf16=arm and torch.ops.mkldnn._is_mkldnn_bf16_supported(),
    )


def bfloat16_native(device: str, processor: Processor | None = None) -> bool:
    """Whether `device` computes bfloat16 natively (every CUDA GPU this project targets does)."""
    if device.startswith("cuda"):
        return True
    return (processor or this_processor()).native_bfloat16


def why(device: str, processor: Processor | None = None) -> str:
    """The reason `auto` chose as it did on `device`, for the command's first line."""
    if device.startswith("cuda"):
        return "a GPU computes bfloat16 natively"
    return (processor or this_processor()).describe()


@lru_cache(maxsize=1)
def bfloat16_slowdown() -> float:
    """How many times slower a bfloat16 matrix product runs than a float32 one on this CPU, measured now on
    256 x 256 matrices (under 0.2 s even where bfloat16 is emulated)."""
    import torch

    def best_seconds(dtype: torch.dtype) -> float:
        a, b = torch.randn(256, 256, dtype=dtype), torch.randn(256, 256, dtype=dtype)
        a @ b  # the first product pays for the kernel's set-up
        times = []
        for _ in range(3):
            start = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - start)
        return min(times)

    return best_seconds(torch.bfloat16) / best_seconds(torch.float32)
