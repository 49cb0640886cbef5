"""ctypes bindings for the few UCP calls ``ucxx``'s Python API does not expose: RMA with rkeys.

``ucxx`` 0.52 gives us the context, worker (with its progress thread) and worker-address endpoints, and their
raw ``ucp_*_h`` handles; memory mapping, rkey packing/unpacking, ``ucp_put_nbx`` and ``ucp_ep_flush_nbx`` come
from the very same ``libucp`` it loaded (``libucx`` wheel), called here by the UCX transport's I/O thread
while ``ucxx``'s progress thread progresses the worker. ``ucxx`` creates workers in ``UCS_THREAD_MODE_MULTI``,
so UCP serialises the two threads itself. Struct layouts follow ``ucp/api/ucp.h`` of UCX 1.21.

Why two bindings of one library: the per-span calls (put, flush, request status and free, worker signal) are
short and never block, so they go through ``ctypes.PyDLL`` and keep the GIL. Through ``CDLL`` each would drop
and retake it, and while an engine thread runs Python a thread that wants the GIL back waits up to the
interpreter's switch interval (5 ms) per call: thousands of puts per prompt. The slow calls (memory mapping,
which pins gigabytes) go through ``CDLL`` and let engine threads run. The price: a put that finds the progress
thread in the middle of one copy waits for the worker's lock with the GIL held, at most one segment
(``cma_segment_bytes``, ~0.7 ms at 8 MiB; a KV-shaped span of ~78 KiB takes ~8 µs). The rule that keeps
``PyDLL`` safe: no Python callback ever runs inside UCP (none is registered with a request or an endpoint),
because one would need the GIL that a ``PyDLL`` caller holds while it waits for the worker's lock.
"""

from __future__ import annotations

import ctypes
import functools
import os

UCS_OK = 0
UCS_INPROGRESS = 1
_UCS_ERR_LAST = -100

_MEM_MAP_FIELD_ADDRESS = 1 << 0
_MEM_MAP_FIELD_LENGTH = 1 << 1
_MEM_MAP_FIELD_PROT = 1 << 3
_MEM_MAP_FIELD_MEMORY_TYPE = 1 << 4
#: ``ucs_memory_type_t`` (ucs/memory/memory_type.h) of the region memory types UCX registers.
_UCS_MEMORY_TYPES = {"host": 0, "cuda": 1}
_PROT_LOCAL_READ = 1 << 0
_PROT_LOCAL_WRITE = 1 << 1
_PROT_REMOTE_READ = 1 << 8
_PROT_REMOTE_WRITE = 1 << 9

_OP_ATTR_FIELD_FLAGS = 1 << 4
_OP_ATTR_FIELD_MEMH = 1 << 8
_OP_ATTR_FLAG_MULTI_SEND = 1 << 19


class _MemMapParams(ctypes.Structure):
    _fields_ = (
        ("field_mask", ctypes.c_uint64),
        ("address", ctypes.c_void_p),
        ("length", ctypes.c_size_t),
        ("flags", ctypes.c_uint),
        ("prot", ctypes.c_uint),
        ("memory_type", ctypes.c_int),
        ("exported_memh_buffer", ctypes.c_void_p),
    )


class _RequestParam(ctypes.Structure):
    _fields_ = (
        ("op_attr_mask", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("request", ctypes.c_void_p),
        ("cb", ctypes.c_void_p),
        ("datatype", ctypes.c_uint64),
        ("user_data", ctypes.c_void_p),
        ("reply_buffer", ctypes.c_void_p),
        ("memory_type", ctypes.c_int),
        ("recv_info", ctypes.c_void_p),
        ("memh", ctypes.c_void_p),
    )


class UcpError(RuntimeError):
    """A UCP call returned an error status."""

    def __init__(self, what: str, status: int) -> None:
        super().__init__(f"{what} failed: {_lib().ucs_status_string(status).decode()} ({status})")
        self.status = status


def _lib() -> ctypes.CDLL:
    """libucp through ``CDLL``: calls release the GIL (for slow calls)."""
    return _bind(ctypes.CDLL)


def _hot_lib() -> ctypes.CDLL:
    """libucp through ``PyDLL``: calls keep the GIL (for the short per-span calls; see the module doc)."""
    return _bind(ctypes.PyDLL)


@functools.cache  # the process has exactly one libucp: one binding per calling convention
def _bind(kind: type[ctypes.CDLL]) -> ctypes.CDLL:
    import libucx

    libucx.load_library()
    path = os.path.join(os.path.dirname(libucx.__file__), "lib", "libucp.so.0")
    lib = kind(path, mode=ctypes.RTLD_GLOBAL)
    vp, sz, u64 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint64
    for name, res, args in (
        ("ucp_mem_map", ctypes.c_int, [vp, ctypes.POINTER(_MemMapParams), ctypes.POINTER(vp)]),
        ("ucp_mem_unmap", ctypes.c_int, [vp, vp]),
        ("ucp_rkey_pack", ctypes.c_int, [vp, vp, ctypes.POINTER(vp), ctypes.POINTER(sz)]),
        ("ucp_rkey_buffer_release", None, [vp]),
        ("ucp_ep_rkey_unpack", ctypes.c_int, [vp, ctypes.c_char_p, ctypes.POINTER(vp)]),
        ("ucp_rkey_destroy", None, [vp]),
        ("ucp_put_nbx", vp, [vp, vp, sz, u64, vp, ctypes.POINTER(_RequestParam)]),
        ("ucp_ep_flush_nbx", vp, [vp, ctypes.POINTER(_RequestParam)]),
        ("ucp_request_check_status", ctypes.c_int, [vp]),
        ("ucp_request_free", None, [vp]),
        ("ucp_worker_signal", ctypes.c_int, [vp]),
        ("ucs_status_string", ctypes.c_char_p, [ctypes.c_int]),
    ):
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
    return lib


def _check(what: str, status: int) -> None:
    if status != UCS_OK:
        raise UcpError(what, status)


def _status_of(ptr: int | None) -> int | None:
    """Decode a ``ucs_status_ptr_t``: None for a live request pointer, else the (OK or error) status."""
    if ptr is None or ptr == 0:
        return UCS_OK
    signed = ctypes.c_int64(ptr).value
    if _UCS_ERR_LAST <= signed < 0:
        return signed
    return None


def memory_type(memory: str) -> int | None:
    """The ``ucs_memory_type_t`` to register a region's memory as: None for host memory (UCX detects it,
    as it always did), ``UCS_MEMORY_TYPE_CUDA`` for device memory (named, so a UCX built without CUDA
    fails the registration instead of treating a device pointer as host memory)."""
    if memory not in _UCS_MEMORY_TYPES:
        raise ValueError(f"UCX registers {sorted(_UCS_MEMORY_TYPES)} memory, not {memory!r}")
    return None if memory == "host" else _UCS_MEMORY_TYPES[memory]


def mem_map(context: int, address: int, length: int, mem_type: int | None = None) -> int:
    """Register ``length`` bytes at ``address`` for local and remote read/write; returns the memh.
    ``mem_type``: a ``ucs_memory_type_t`` (``memory_type``), None to let UCX detect it."""
    params = _MemMapParams(
        field_mask=_MEM_MAP_FIELD_ADDRESS | _MEM_MAP_FIELD_LENGTH | _MEM_MAP_FIELD_PROT,
        address=address,
        length=length,
        prot=_PROT_LOCAL_READ | _PROT_LOCAL_WRITE | _PROT_REMOTE_READ | _PROT_REMOTE_WRITE,
    )
    if mem_type is not None:
        params.field_mask |= _MEM_MAP_FIELD_MEMORY_TYPE
        params.memory_type = mem_type
    memh = ctypes.c_void_p()
    _check("ucp_mem_map", _lib().ucp_mem_map(context, ctypes.byref(params), ctypes.byref(memh)))
    assert memh.value is not None
    return memh.value


def mem_unmap(context: int, memh: int) -> None:
    _check("ucp_mem_unmap", _lib().ucp_mem_unmap(context, memh))


def rkey_pack(context: int, memh: int) -> bytes:
    """The packed remote key peers need to write into ``memh``'s memory."""
    buf, size = ctypes.c_void_p(), ctypes.c_size_t()
    _check("ucp_rkey_pack", _lib().ucp_rkey_pack(context, memh, ctypes.byref(buf), ctypes.byref(size)))
    try:
        return ctypes.string_at(buf, size.value)
    finally:
        _lib().ucp_rkey_buffer_release(buf)


def rkey_unpack(ep: int, packed: bytes) -> int:
    rkey = ctypes.c_void_p()
    _check("ucp_ep_rkey_unpack", _lib().ucp_ep_rkey_unpack(ep, packed, ctypes.byref(rkey)))
    assert rkey.value is not None
    return rkey.value


def rkey_destroy(rkey: int) -> None:
    _lib().ucp_rkey_destroy(rkey)


class Poster:
    """Posts puts and flushes on one worker; keeps one reusable parameter block per kind of call."""

    def __init__(self, worker: int) -> None:
        lib = _hot_lib()
        self._worker = worker
        self._signal = lib.ucp_worker_signal
        self._put = lib.ucp_put_nbx
        self._flush_fn = lib.ucp_ep_flush_nbx
        self._free = lib.ucp_request_free
        self._check_status = lib.ucp_request_check_status
        self._put_params: dict[int, _RequestParam] = {}
        self._no_params = _RequestParam()

    def put_many(
        self, ep: int, local: list[int], sizes: list[int], remote: list[int], rkey: int, memh: int
    ) -> None:
        """Post one put per (local address, size, remote address) of one region pair.

        Requests are released at once (completion is observed by ``flush``); a put that completes inline
        returns NULL, so the common path is one ctypes call per span.
        """
        param = self._put_params.get(memh)
        if param is None:
            param = _RequestParam(
                op_attr_mask=_OP_ATTR_FIELD_MEMH | _OP_ATTR_FIELD_FLAGS,
                flags=_OP_ATTR_FLAG_MULTI_SEND,
                memh=memh,
            )
            self._put_params[memh] = param
        ref, put = ctypes.byref(param), self._put
        for src, size, dst in zip(local, sizes, remote, strict=True):
            ptr = put(ep, src, size, dst, rkey, ref)
            if ptr is not None:
                status = _status_of(ptr)
                if status is None:
                    self._free(ptr)
                elif status != UCS_OK:
                    raise UcpError("ucp_put_nbx", status)

    def forget(self, memh: int) -> None:
        self._put_params.pop(memh, None)

    def flush(self, ep: int) -> int | None:
        """Start an endpoint flush: returns a request to poll with ``request_status``, or None if done.

        Then wakes the worker: a queued shared-memory put raises no event, and the progress thread may be
        asleep in epoll.
        """
        ptr = self._flush_fn(ep, ctypes.byref(self._no_params))
        _check("ucp_worker_signal", self._signal(self._worker))
        status = _status_of(ptr)
        if status is None:
            return int(ptr)
        if status != UCS_OK:
            raise UcpError("ucp_ep_flush_nbx", status)
        return None

    def request_status(self, request: int) -> int:
        """UCS_INPROGRESS while running; otherwise the final status (the request is then freed)."""
        status = int(self._check_status(request))
        if status != UCS_INPROGRESS:
            self._free(request)
        return status
