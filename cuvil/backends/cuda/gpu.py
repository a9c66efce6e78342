"""Running a CUDA plan on the GPU: each kernel of the layer loaded through the driver API
(driver.py) in the image this GPU takes (images.py), launched on torch's current stream, with
GEMMs and convolutions through ATen (cuBLAS, cuDNN) in between — torch and the NVIDIA driver
are all it needs (no Triton, no compiler).

Plans compute in fp32 on the GPU as they were verified: TF32 is off for cuBLAS and cuDNN while
the plan runs (``gpu_math``; torch's own defaults let cuDNN use it), unless the model was
compiled at precision tf32.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

from cuvil.backends.cuda.driver import Driver, DriverError, DriverKernel
from cuvil.backends.cuda.images import Image, choose_image

log = logging.getLogger("cuvil.backends.cuda")


@contextmanager
def gpu_math(allow_tf32: bool = False) -> Iterator[None]:
    """cuBLAS and cuDNN with TF32 allowed or not for the block (restored after)."""
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    saved = (matmul.allow_tf32, cudnn.allow_tf32)
    matmul.allow_tf32 = cudnn.allow_tf32 = allow_tf32
    try:
        yield
    finally:
        matmul.allow_tf32, cudnn.allow_tf32 = saved


def device_capability(device: torch.device) -> int:
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


class GpuKernel:
    """One kernel launched on the GPU (launches.py's ``Launcher``)."""

    def __init__(self, kernel: DriverKernel, image: Image, ordinal: int) -> None:
        self.kernel, self.image, self.ordinal = kernel, image, ordinal

    def launch(
        self, grid: tuple[int, ...], args: Mapping[str, Any], reach: Mapping[str, int]
    ) -> None:
        for name, value in args.items():
            if isinstance(value, torch.Tensor) and not value.is_cuda:
                raise DriverError(f"{self.image.symbol}: {name} is on {value.device}, not a GPU")
        self.kernel.driver.ensure_context(self.ordinal)
        stream = torch.cuda.current_stream().cuda_stream
        self.kernel.launch(grid, args, reach, stream=stream)


def load_gpu_kernels(
    manifests: Mapping[str, Mapping[str, Any]],
    files: Mapping[str, bytes],
    device: torch.device,
    driver: Driver | None = None,
) -> dict[str, GpuKernel]:
    """Every kernel loaded for ``device`` (see ``load_images``)."""
    ordinal = device.index if device.index is not None else torch.cuda.current_device()
    torch.empty(0, device=device)  # torch's context is current on this thread from here on
    return load_images(
        manifests,
        files,
        device_capability(device),
        torch.cuda.get_device_name(device),
        ordinal,
        driver or Driver(),
    )


def load_images(
    manifests: Mapping[str, Mapping[str, Any]],
    files: Mapping[str, bytes],
    capability: int,
    device_name: str,
    ordinal: int,
    driver: Driver,
) -> dict[str, GpuKernel]:
    """Every kernel's image for a GPU of ``capability`` loaded through ``driver``; an
    ``ArchitectureError`` naming the artifact's and the GPU's architectures when a kernel has
    no image this GPU runs (before anything is loaded)."""
    images = {kernel: choose_image(m, capability, device_name) for kernel, m in manifests.items()}
    jitted = sorted(kernel for kernel, image in images.items() if image.kind == "ptx")
    if jitted:
        log.warning(
            "%d kernel(s) JIT-compiled from %s PTX for this sm_%d GPU (%s): compile the model "
            "for cuda-sm_%d for its own cubins",
            len(jitted),
            images[jitted[0]].arch,
            capability,
            device_name,
            capability,
        )
    driver.ensure_context(ordinal)
    return {
        kernel: GpuKernel(
            DriverKernel(
                driver,
                manifests[kernel],
                files[image.file],
                symbol=image.symbol,
                shared=image.shared,
            ),
            image,
            ordinal,
        )
        for kernel, image in images.items()
    }
