"""What one GPU allows a kernel: the numbers strategies size tiles and grids by.

One helper, ``device_limits(device)``, cached per device, so that no plugin keeps
its own copy of a shared-memory constant. Plans made without a GPU (the CPU
interpreter) get the numbers of an H100/H200, the chip the configs are tuned on.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Union

import torch

#: Shared memory the tiles of one block may take: below the H100/H200's 227 KiB so the
#: compiler's own scratch (layout conversions, reduction buffers) still fits. A tuning
#: budget, not a read-out of the chip: every GPU gets it, so tuning stays as it was.
TILE_SHARED_MEMORY = 200 * 1024
#: Shared memory one block may use at most on an H100/H200 (``sharedMemPerBlockOptin``):
#: for a kernel that needs nearly all of it (the MLP's persistent form). Kept as this
#: constant on every GPU as well, so a plan does not change with the chip it is made on.
BLOCK_SHARED_MEMORY_MAX = 227 * 1024
#: Streaming multiprocessors assumed without a GPU (H100/H200: 132).
MULTIPROCESSORS_WITHOUT_GPU = 132


@dataclass(frozen=True)
class DeviceLimits:
    """Limits of one device, as strategies use them.

    :param shared_memory_per_block: bytes of shared memory a block's pipelined tiles
        may take (``TILE_SHARED_MEMORY`` on every device).
    :param shared_memory_per_block_max: bytes of shared memory one block may use at
        most (``BLOCK_SHARED_MEMORY_MAX`` on every device).
    :param multiprocessors: streaming multiprocessors: read from the GPU
        (``torch.cuda.get_device_properties``), ``MULTIPROCESSORS_WITHOUT_GPU`` for a
        device that is none.
    """

    shared_memory_per_block: int
    shared_memory_per_block_max: int
    multiprocessors: int


def device_limits(device: Union[None, str, int, torch.device] = None) -> DeviceLimits:
    """The ``DeviceLimits`` of ``device``, cached per device.

    :param device: a device, its name or a CUDA index; ``None``: the current CUDA
        device where there is one, else the CPU. A device that is not CUDA gets the
        H100/H200 numbers plans without a GPU assume.
    """
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    elif isinstance(device, int):
        device = torch.device("cuda", device)
    else:
        device = torch.device(device)
    if device.type != "cuda":
        return _limits_of(None)
    return _limits_of(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _limits_of(cuda_index: Optional[int]) -> DeviceLimits:
    multiprocessors = (
        MULTIPROCESSORS_WITHOUT_GPU
        if cuda_index is None
        else torch.cuda.get_device_properties(cuda_index).multi_processor_count
    )
    return DeviceLimits(TILE_SHARED_MEMORY, BLOCK_SHARED_MEMORY_MAX, multiprocessors)
