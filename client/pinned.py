"""The arena mapping registered as pinned (page-locked) host memory for a GPU.

A KV cache on CUDA is filled from and saved to the shared-memory arena by
DMA. From pageable memory the driver stages every copy through a bounce
buffer of its own, synchronously; from registered memory it copies straight
and asynchronously. So the data region of the mapping is registered once
(cudaHostRegister, through torch), not per copy: registering pins and
faults in every page, which costs far more than one block's copy.

While registered, PinnedArena keeps a view of the mapping: ArenaMapping.close
then cannot unmap it (see there), so the registered address range is never
unmapped and reused by another mapping under the driver's feet (a DMA would
then read the old pages). A new mapping (the daemon restarted), a closed one
or close() unregisters first and only then drops the view.

The registrar is injected: `cuda_registrar()` is torch's cudart; tests pass a
fake. This module imports neither torch nor CUDA itself (clients install
without them).
"""
from __future__ import annotations

import ctypes
import logging
import os
from typing import Any, Callable, Optional, Protocol

__all__ = ["PinnedArena", "Registrar", "RegisterError", "cuda_registrar"]

log = logging.getLogger("kvkeeper.client")


class RegisterError(RuntimeError):
    """cudaHostRegister or cudaHostUnregister failed (its error in the message)."""


class Registrar(Protocol):
    def register(self, address: int, nbytes: int) -> None: ...

    def unregister(self, address: int) -> None: ...


class _CudaRegistrar:
    """cudaHostRegister / cudaHostUnregister through torch.cuda.cudart()."""

    def __init__(self) -> None:
        import torch

        self._torch = torch
        self._rt = torch.cuda.cudart()

    def _check(self, err: Any, what: str) -> None:
        code = int(err)
        if code:
            # torch's binding leaves the error as CUDA's last error, which the
            # next kernel launch anywhere in this thread would report as its
            # own: in vLLM, an unrelated forward failing. Take it back.
            cleared = clear_last_cuda_error()
            try:
                name = f" ({self._rt.cudaGetErrorString(err)})"
            except Exception:  # noqa: BLE001 - the code alone is enough
                name = ""
            raise RegisterError(f"{what} failed: CUDA error {code}{name}" + (
                "" if cleared else "; CUDA's last error could not be cleared"))

    def register(self, address: int, nbytes: int) -> None:
        # Flags 0 (cudaHostRegisterDefault): pinned for this process's context.
        self._check(self._rt.cudaHostRegister(address, nbytes, 0), "cudaHostRegister")

    def unregister(self, address: int) -> None:
        self._check(self._rt.cudaHostUnregister(address), "cudaHostUnregister")


_LAST_ERROR: list = []    # [cudaGetLastError of the libcudart torch loaded, or None]


def clear_last_cuda_error() -> bool:
    """cudaGetLastError() (which resets it) through the libcudart this process
    already loaded (torch.cuda.cudart() has no binding for it); only a
    library already mapped, never another copy with a state of its own.
    False when there is none (a cudart linked statically)."""
    if not _LAST_ERROR:
        fn = None
        try:
            with open("/proc/self/maps") as f:
                paths = sorted({ln.split()[-1] for ln in f if "libcudart" in ln.rsplit("/", 1)[-1]})
        except OSError:
            paths = []
        for path in paths:
            try:
                fn = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY).cudaGetLastError
                break
            except (OSError, AttributeError):
                continue
        _LAST_ERROR.append(fn)
    fn = _LAST_ERROR[0]
    if fn is None:
        return False
    fn()
    return True


def cuda_registrar() -> Registrar:
    """torch's CUDA runtime as a Registrar (imports torch; needs CUDA)."""
    return _CudaRegistrar()


def _address(view: memoryview) -> int:
    """The address of a writable view's first byte (the ctypes export is dropped at once)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


class PinnedArena:
    """At most one arena mapping registered as pinned memory at a time."""

    def __init__(self, registrar_factory: Callable[[], Registrar] = cuda_registrar) -> None:
        self._factory = registrar_factory
        self._registrar: Optional[Registrar] = None
        self._mapping: Any = None
        self._view: Optional[memoryview] = None
        self._address = 0
        self._failed: Any = None      # a mapping whose registration failed: not retried
        self._leaked: list = []       # views kept because unregistering them failed

    @property
    def mapping(self) -> Any:
        """The mapping registered now, or None."""
        return self._mapping

    @property
    def address(self) -> int:
        """The registered data region's first byte (0: none)."""
        return self._address

    @property
    def nbytes(self) -> int:
        return self._view.nbytes if self._view is not None else 0

    def span(self, address: int, nbytes: int) -> memoryview:
        """A view of [address, address + nbytes) of the registered region (a
        slice of the view kept: usable while registered, even after the
        mapping object was closed)."""
        if not self.contains(address, nbytes):
            raise ValueError(f"[{address:#x}, +{nbytes}) is not in the pinned region")
        assert self._view is not None
        start = address - self._address
        return self._view[start:start + nbytes]

    def contains(self, address: int, nbytes: int) -> bool:
        """Whether [address, address + nbytes) lies in the registered region."""
        return bool(self._view is not None and self._address <= address
                    and address + nbytes <= self._address + self._view.nbytes)

    def ensure(self, mapping: Any) -> bool:
        """Have `mapping`'s data region registered (an ArenaMapping: data_offset,
        size_bytes, closed, view). Registers only when it is not the one
        registered already; a mapping whose registration failed is not tried
        again. True when it is registered on return."""
        if mapping is None or getattr(mapping, "closed", True):
            if self._mapping is not None and getattr(self._mapping, "closed", False):
                self.close()
            return False
        if mapping is self._mapping:
            return True
        if mapping is self._failed:
            return False
        self.close()
        try:
            if self._registrar is None:
                self._registrar = self._factory()
            view = mapping.view(mapping.data_offset, mapping.size_bytes - mapping.data_offset)
            address = _address(view)
            self._registrar.register(address, view.nbytes)
        except Exception as e:  # noqa: BLE001 - pinning is only faster: copies work unpinned
            log.warning("kvkeeper: registering the arena mapping as pinned memory failed (%s); "
                        "host<->GPU copies of it are staged by the driver", e)
            self._failed = mapping
            return False
        self._mapping, self._view, self._address = mapping, view, address
        return True

    def close(self) -> None:
        """Unregister the mapping (if any), then let it be unmapped. Idempotent."""
        view, self._view = self._view, None
        address, self._address = self._address, 0
        self._mapping = None
        if view is None:
            return
        try:
            assert self._registrar is not None
            self._registrar.unregister(address)
        except Exception as e:  # noqa: BLE001 - keep the view: never unmap registered memory
            log.error("kvkeeper: unregistering the pinned arena mapping failed: %s; it stays "
                      "mapped", e)
            self._leaked.append(view)
            return
        view.release()

    def __enter__(self) -> "PinnedArena":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
