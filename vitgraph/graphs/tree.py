"""Flatten call arguments and outputs into tensor leaves plus a hashable spec.

A spec remembers the container structure (tuple, list, dict, namedtuple) and every
non-tensor leaf (None, bools, ints, strings, dtypes ...) by position, so that

    leaves, spec = flatten(obj)
    unflatten(leaves, spec)   # == obj, with the tensors swapped for `leaves`

Only the tensors travel through a CUDA graph; everything else is part of the spec and is
put back unchanged. torch.utils._pytree is close, but it keeps ints and strings as leaves
next to the tensors and drops None from the leaves, and it is private API: this module is
small and its behaviour is ours.

Specs are nested tuples and hashable when the constants are, so they can be part of a
graph key. `Unsupported` is raised for leaves that cannot be treated as constants (an
object that may hold tensors, such as a dataclass): a graph would bake in a stale object.

Known argument dataclasses are the exception (`DATACLASSES`: megatron's PackedSeqParams):
their tensor fields (cu_seqlens ...) are leaves like any tensor -- static inputs of a graph,
copied in before each replay -- and their other fields (qkv_format, max_seqlen_*, a
process group) constants of the spec, so one capture serves every pack with the same
layout. A field holding the same tensor as an earlier field (cu_seqlens_kv is
cu_seqlens_q) stays one leaf and comes back as the same object.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import torch

# leaf kinds in a spec
_T = "T"  # tensor leaf: ("T",)
_C = "C"  # constant leaf: ("C", value)
_TUPLE = "tuple"
_LIST = "list"
_DICT = "dict"  # ("dict", type, keys, children)
_NT = "nt"  # namedtuple: ("nt", type, children)
_DC = "dc"  # known dataclass: ("dc", type, field names, children)
_SAME = "="  # inside a dataclass: ("=", index of the earlier field holding the same tensor)

_CONST_TYPES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device,
                torch.Size, torch.memory_format, torch.layout, enum.Enum, type(Ellipsis))


class Unsupported(TypeError):
    """A leaf that is neither a tensor nor a plain constant."""


def _known_dataclasses() -> tuple:
    out = []
    try:
        from megatron.core.packed_seq_params import PackedSeqParams
        out.append(PackedSeqParams)
    except ImportError:  # pragma: no cover - megatron is a hard dependency
        pass
    return tuple(out)


# dataclasses whose fields are tensors or constants, passed through graphs field by field
DATACLASSES: tuple = _known_dataclasses()


def _is_const(obj: Any) -> bool:
    if isinstance(obj, _CONST_TYPES):
        return True
    # a process group (PackedSeqParams.cp_group): by identity, as the graph's NCCL calls are
    dist = getattr(torch, "distributed", None)
    pg = getattr(dist, "ProcessGroup", None) if dist is not None and dist.is_available() else None
    return pg is not None and isinstance(obj, pg)


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


def flatten(obj: Any) -> tuple[list[torch.Tensor], tuple]:
    leaves: list[torch.Tensor] = []
    spec = _flatten(obj, leaves)
    return leaves, spec


def _flatten(obj: Any, leaves: list) -> tuple:
    if isinstance(obj, torch.Tensor):
        leaves.append(obj)
        return (_T,)
    if _is_const(obj):
        return (_C, obj)
    if type(obj) in DATACLASSES:
        return _flatten_dataclass(obj, leaves)
    if _is_namedtuple(obj):
        return (_NT, type(obj), tuple(_flatten(v, leaves) for v in obj))
    if type(obj) is tuple:
        return (_TUPLE, tuple(_flatten(v, leaves) for v in obj))
    if type(obj) is list:
        return (_LIST, tuple(_flatten(v, leaves) for v in obj))
    if isinstance(obj, dict):
        keys = tuple(obj.keys())
        return (_DICT, type(obj), keys, tuple(_flatten(obj[k], leaves) for k in keys))
    if isinstance(obj, (tuple, list)):
        # subclasses of tuple/list that are not namedtuples: rebuild through the type
        kind = _TUPLE if isinstance(obj, tuple) else _LIST
        return (kind + ":" + type(obj).__qualname__, type(obj), tuple(_flatten(v, leaves) for v in obj))
    raise Unsupported(f"cannot pass a {type(obj).__module__}.{type(obj).__qualname__} through a graph")


def _flatten_dataclass(obj: Any, leaves: list) -> tuple:
    names = tuple(f.name for f in dataclasses.fields(obj) if f.init)
    children, seen = [], {}
    for i, n in enumerate(names):
        v = getattr(obj, n)
        if isinstance(v, torch.Tensor) and id(v) in seen:
            children.append((_SAME, seen[id(v)]))
            continue
        if isinstance(v, torch.Tensor):
            seen[id(v)] = i
        elif not _is_const(v):
            raise Unsupported(f"{type(obj).__qualname__}.{n} is a {type(v).__qualname__}: "
                              "neither a tensor nor a constant")
        children.append(_flatten(v, leaves))
    return (_DC, type(obj), names, tuple(children))


def unflatten(leaves, spec: tuple) -> Any:
    it = iter(leaves)
    out = _unflatten(it, spec)
    rest = next(it, _SENTINEL)
    if rest is not _SENTINEL:
        raise ValueError("more leaves than the spec has tensor slots")
    return out


_SENTINEL = object()


def _unflatten(it, spec: tuple) -> Any:
    kind = spec[0]
    if kind == _T:
        try:
            return next(it)
        except StopIteration:
            raise ValueError("fewer leaves than the spec has tensor slots") from None
    if kind == _C:
        return spec[1]
    if kind == _TUPLE:
        return tuple(_unflatten(it, s) for s in spec[1])
    if kind == _LIST:
        return [_unflatten(it, s) for s in spec[1]]
    if kind == _DICT:
        typ, keys, children = spec[1], spec[2], spec[3]
        d = {k: _unflatten(it, s) for k, s in zip(keys, children)}
        return d if typ is dict else typ(d)
    if kind == _NT:
        return spec[1](*(_unflatten(it, s) for s in spec[2]))
    if kind == _DC:
        values: list = []
        for s in spec[3]:
            values.append(values[s[1]] if s[0] == _SAME else _unflatten(it, s))
        return spec[1](**dict(zip(spec[2], values)))
    # tuple/list subclass
    return spec[1](_unflatten(it, s) for s in spec[2])


def num_tensors(spec: tuple) -> int:
    kind = spec[0]
    if kind == _T:
        return 1
    if kind in (_C, _SAME):
        return 0
    children = spec[-1]
    return sum(num_tensors(s) for s in children)
