"""kvkeeper.client.pinned.PinnedArena with a fake registrar (no CUDA)."""
from __future__ import annotations

import mmap
import os
import tempfile
from typing import List, Tuple

import pytest

from kvkeeper.client.arena_mapping import ArenaMapping, file_id
from kvkeeper.client.pinned import PinnedArena, RegisterError

PAGE = 4096


class FakeRegistrar:
    def __init__(self, fail_register: bool = False, fail_unregister: bool = False) -> None:
        self.calls: List[Tuple[str, int, int]] = []
        self.live: dict = {}
        self.fail_register, self.fail_unregister = fail_register, fail_unregister

    def register(self, address: int, nbytes: int) -> None:
        if self.fail_register:
            raise RegisterError("cudaHostRegister failed: CUDA error 1")
        assert address not in self.live, "registered twice"
        self.live[address] = nbytes
        self.calls.append(("register", address, nbytes))

    def unregister(self, address: int) -> None:
        if self.fail_unregister:
            raise RegisterError("cudaHostUnregister failed: CUDA error 1")
        del self.live[address]
        self.calls.append(("unregister", address, 0))


def make_mapping(pages: int = 8) -> ArenaMapping:
    fd, path = tempfile.mkstemp(prefix="kvk-pinned-test-")
    try:
        size = PAGE * (pages + 1)
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        return ArenaMapping(path, size, b"a" * 16, PAGE, pages, PAGE, file_id(os.fstat(fd)), mm)
    finally:
        os.close(fd)
        os.unlink(path)


def test_registers_the_data_region_once_and_unregisters_on_close() -> None:
    reg = FakeRegistrar()
    m = make_mapping()
    p = PinnedArena(lambda: reg)
    assert p.ensure(m) and p.ensure(m) and p.ensure(m)
    assert [c[0] for c in reg.calls] == ["register"]
    _, addr, nbytes = reg.calls[0]
    assert nbytes == m.size_bytes - m.data_offset == p.nbytes and addr == p.address
    # the span of a registered address is the mapping's bytes there
    m.write([(PAGE + 10, 3)], b"xyz", whole=True)
    assert bytes(p.span(addr + 10, 3)) == b"xyz"
    assert p.contains(addr, nbytes) and not p.contains(addr, nbytes + 1)
    with pytest.raises(ValueError):
        p.span(addr + nbytes - 1, 2)
    p.close()
    assert reg.calls[-1] == ("unregister", addr, 0) and not reg.live
    assert p.mapping is None and p.address == 0
    p.close()   # idempotent
    assert len(reg.calls) == 2
    m.close()


def test_registered_mapping_stays_mapped_until_unregistered() -> None:
    reg = FakeRegistrar()
    m = make_mapping()
    p = PinnedArena(lambda: reg)
    assert p.ensure(m)
    addr = p.address
    m.write([(PAGE, 4)], b"keep", whole=True)
    m.close()          # the client drops the arena: registered pages must stay mapped
    assert bytes(p.span(addr, 4)) == b"keep"
    assert not p.ensure(m)      # closed: unregistered now
    assert reg.calls[-1][0] == "unregister" and not reg.live


def test_a_new_mapping_replaces_the_old_one() -> None:
    reg = FakeRegistrar()
    a, b = make_mapping(), make_mapping(4)
    p = PinnedArena(lambda: reg)
    assert p.ensure(a)
    first = p.address
    assert p.ensure(b)
    assert [c[0] for c in reg.calls] == ["register", "unregister", "register"]
    assert reg.calls[1][1] == first and p.mapping is b and p.nbytes == 4 * PAGE
    p.close()
    a.close()
    b.close()


def test_failed_registration_leaves_nothing_and_is_not_retried() -> None:
    reg = FakeRegistrar(fail_register=True)
    m = make_mapping()
    p = PinnedArena(lambda: reg)
    assert not p.ensure(m) and not p.ensure(m)
    assert p.mapping is None and not reg.calls
    p.close()
    m.close()
    assert not PinnedArena(lambda: reg).ensure(None)


def test_failed_unregistration_never_unmaps() -> None:
    reg = FakeRegistrar(fail_unregister=True)
    m = make_mapping()
    p = PinnedArena(lambda: reg)
    assert p.ensure(m)
    view_addr = p.address
    p.close()
    assert p.mapping is None and reg.live == {view_addr: m.size_bytes - m.data_offset}
    m.close()   # the kept view holds the pages mapped: no crash reading through the mapping


class _FakeRuntime:
    """torch.cuda.cudart()'s surface: error codes, as pybind enums convert to int."""

    def __init__(self, code: int) -> None:
        self.code = code

    def cudaHostRegister(self, address: int, nbytes: int, flags: int) -> int:
        return self.code

    def cudaHostUnregister(self, address: int) -> int:
        return self.code

    def cudaGetErrorString(self, err: int) -> str:
        return "cudaErrorHostMemoryAlreadyRegistered"


def test_a_failed_cuda_call_clears_cuda_last_error(monkeypatch) -> None:
    """The failure is raised as RegisterError, and CUDA's last error is taken
    back, so vLLM's next kernel launch does not report it as its own."""
    from kvkeeper.client import pinned

    cleared: List[int] = []
    monkeypatch.setattr(pinned, "clear_last_cuda_error", lambda: cleared.append(1) or True)
    reg = object.__new__(pinned._CudaRegistrar)
    reg._rt = _FakeRuntime(712)
    with pytest.raises(RegisterError, match=r"cudaHostRegister failed: CUDA error 712 "
                                            r"\(cudaErrorHostMemoryAlreadyRegistered\)$"):
        reg.register(4096, 4096)
    with pytest.raises(RegisterError, match="cudaHostUnregister failed"):
        reg.unregister(4096)
    assert cleared == [1, 1]
    reg._rt = _FakeRuntime(0)
    reg.register(4096, 4096)
    reg.unregister(4096)
    assert cleared == [1, 1]


def test_clearing_uses_only_a_cudart_already_loaded(monkeypatch) -> None:
    """No libcudart mapped here (no CUDA): nothing is loaded, False."""
    from kvkeeper.client import pinned

    monkeypatch.setattr(pinned, "_LAST_ERROR", [])
    with open("/proc/self/maps") as f:
        mapped = any("libcudart" in ln for ln in f)
    assert pinned.clear_last_cuda_error() is mapped
