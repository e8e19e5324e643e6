"""torch.Tensor <-> DLManagedTensor* through torch.utils.dlpack, without copies.

A tensor handed to the library: its DLPack capsule is marked used
("used_dltensor", the DLPack protocol's way of taking ownership), and the
library calls the DLManagedTensor's deleter when it is done with the memory.
A tensor coming back: a capsule named "dltensor" around the library's
DLManagedTensor, consumed at once by torch.utils.dlpack.from_dlpack.
"""
import ctypes

import torch
import torch.utils.dlpack

_api = ctypes.pythonapi
_api.PyCapsule_GetPointer.restype = ctypes.c_void_p
_api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_api.PyCapsule_SetName.restype = ctypes.c_int
_api.PyCapsule_SetName.argtypes = [ctypes.py_object, ctypes.c_char_p]
_api.PyCapsule_New.restype = ctypes.py_object
_api.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]

# Capsule names must outlive the capsules: module constants.
_DLTENSOR = b"dltensor"
_USED = b"used_dltensor"


class _DLManagedTensorHead(ctypes.Structure):
    # Only what _free needs: DLTensor (data, device, ndim, dtype, shape,
    # strides, byte_offset), then manager_ctx and deleter.
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device_type", ctypes.c_int),
        ("device_id", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("dtype", ctypes.c_uint32),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("byte_offset", ctypes.c_uint64),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.CFUNCTYPE(None, ctypes.c_void_p)),
    ]


def give(t):
    """A DLManagedTensor* (int) over t's memory, owned by the receiver; None for None.

    t must be contiguous (a strided tensor is refused by the library, so it is
    made contiguous here, which copies). Keep t's values unchanged until the
    library is done with them, as with any op that saves its inputs.
    """
    if t is None:
        return None
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    cap = torch.utils.dlpack.to_dlpack(t)
    ptr = _api.PyCapsule_GetPointer(cap, _DLTENSOR)
    _api.PyCapsule_SetName(cap, _USED)
    return ptr


def free(ptr):
    """Calls the deleter of a DLManagedTensor* nobody took."""
    if ptr:
        head = _DLManagedTensorHead.from_address(ptr)
        if head.deleter:
            head.deleter(ptr)


def take(ptr):
    """A torch.Tensor over the library's DLManagedTensor* (None for NULL)."""
    if not ptr:
        return None
    try:
        cap = _api.PyCapsule_New(ptr, _DLTENSOR, None)
        return torch.utils.dlpack.from_dlpack(cap)
    except BaseException:
        free(ptr)
        raise


def stream_of(t):
    """The cudaStream_t (int) of torch's current stream on t's device; None on the CPU."""
    if t is None or not t.is_cuda:
        return None
    return torch.cuda.current_stream(t.device).cuda_stream
