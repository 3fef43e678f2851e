"""The ranks' CPU memory allocator: ``--allocator system`` (the C library's, as configured) or ``retain``.

glibc hands every allocation of 128 KiB or more (its ``mmap`` threshold, which it raises on its own up to 32 MiB)
straight from the kernel, and gives it back when it is freed: the next step's tensor of that size starts again on
pages no one has touched, and each first touch is a page fault. On a bare Linux host a fault costs ~0.1-0.5 µs; on
this project's 2-vCPU VMs ~7 µs (session 30: 16.5 k faults for 112 MiB of fresh tensors, 158 ms against 45 ms
with ``retain``), so a step that allocates and frees table-sized tensors pays tens of milliseconds per 16 MiB.
A DDP whose buffers persist (PyTorch's C++ Reducer) does not pay it for communication; one whose compiled
backward allocates its buckets afresh each step (graphddp's in-graph reduction) does, and the matrix then
measures the VM's page faults as much as the schedules.

``retain`` sets glibc's tunables through the environment of every rank (read when the process starts): no
``mmap`` for allocations under 4 GiB and no trimming of the heap's top, so freed memory stays with the process and
is reused, as a caching allocator (CUDA's, jemalloc, tcmalloc) does; PyTorch's CPU performance tuning guide
recommends jemalloc or tcmalloc for the same reason. The process's resident memory then stays at its peak. A C
library other than glibc ignores the variables.
"""

from __future__ import annotations

import resource

ALLOCATORS = ("system", "retain")

_RETAIN = {
    "MALLOC_MMAP_THRESHOLD_": str(4 << 30),  # allocations under 4 GiB come from the heap, not fresh mappings
    "MALLOC_TRIM_THRESHOLD_": str(16 << 30),  # the heap's free top is not given back to the kernel
    "MALLOC_TOP_PAD_": str(256 << 20),  # and grows in 256 MiB steps
}


def allocator_env(allocator: str) -> dict[str, str]:
    """The environment variables a rank starts with for ``allocator`` (one of ``ALLOCATORS``)."""
    if allocator not in ALLOCATORS:
        raise ValueError(f"allocator must be one of {', '.join(ALLOCATORS)}, got {allocator!r}")
    return dict(_RETAIN) if allocator == "retain" else {}


def minor_page_faults() -> int:
    """This process's minor page faults so far (every thread's): each first touch of a page the kernel has just
    mapped. glibc maps large allocations afresh and unmaps them when freed (above), so a DDP that allocates its
    buffers each step pays a fault per 4 KiB page each step; on a VM with nested paging that is microseconds each.
    Counted, not timed: the ``page faults`` columns of ``bench`` and ``bench.overhead`` say which mode allocates
    afresh, whatever the machine's noise."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
