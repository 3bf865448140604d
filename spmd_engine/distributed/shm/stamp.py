"""The all-reduce's stamps: each rank's header for an operation, which is also its counter.

Why this shape: the check that ranks agree on an operation (number, kind, dtype, sizes)
must not cost more than the counter it replaced, so a rank publishes its whole stamp with
one store call (`RECORD.pack_into`, after its data) and reads every rank's stamp, broken
words included, with one load call (`header(...).unpack_from`), compared to the stamp it
expects as one tuple.

A stamp is three 8-byte words:  gen << 8 | code,  tag | chunk bytes,  tag | total bytes,
where tag is the operation number's low 14 bits with bit 62 set (never zero). Every word
thus says which operation wrote it, so one read of all words sees either a word of this
operation, final, or an older one: a reader never needs the words stored in any order (a
store call may write them in any order, zeroing first), only each aligned word stored
whole, and it never takes a stamp half old, half new, for a match or a mismatch. A word
whose store it observes comes after the writer's data (x86 TSO), so the data is there.

While a rank waits for operation g, a peer's stamp in that buffer is of g - 2 (or the
initial zeros) or of g: it cannot reach g + 2 before this rank publishes g + 1. A first
word beyond g means the ranks disagree on the count: a mismatch, at once.
"""

from __future__ import annotations

import struct

import torch

LINE = 128  # bytes per rank: broken word, a stamp per buffer; two cache lines, no false sharing
BROKEN = 0  # the broken word: int64 0 of a rank's line, and of each rank's four in a header read
_RECORD_AT = (8, 32)  # byte offset in a rank's line of its stamp for buffer 0 and buffer 1
RECORD = struct.Struct("@3Q")  # native: each field one aligned 8-byte store or load
_VALUE = (1 << 48) - 1
_TAG = 0x3FFF
OPS = {"all_reduce": 1, "all_gather": 2}
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64,
                    torch.int32, torch.int64)
DTYPE_CODE = {dtype: i for i, dtype in enumerate(SUPPORTED_DTYPES)}


def record_offset(rank: int, buf: int) -> int:
    return rank * LINE + _RECORD_AT[buf]


def header(nranks: int, buf: int) -> struct.Struct:
    """Reads (broken, w0, w1, w2) of every rank for buffer `buf`, from the segment's start."""
    at = _RECORD_AT[buf]
    one = f"Q{at - 8}x3Q" if at > 8 else "4Q"
    pad = f"{LINE - at - 24}x"
    return struct.Struct("@" + pad.join([one] * nranks))


def tag(gen: int) -> int:
    return ((gen & _TAG) | 0x4000) << 48


def code(op: str, dtype: torch.dtype) -> int:
    return OPS[op] * 64 + DTYPE_CODE[dtype]


def settled(got: tuple, gen: int, want: tuple | None = None) -> bool:
    """Whether the wait for operation `gen` is over: `got` is `want`, a rank declared itself
    broken, or every rank's stamp is whole and of `gen` or beyond (then `got` is final:
    compare it)."""
    if got == want or any(got[0::4]):
        return True
    t = tag(gen)
    for w0, w1, w2 in zip(got[1::4], got[2::4], got[3::4]):
        seen = w0 >> 8
        if seen < gen or (seen == gen and (w1 & ~_VALUE != t or w2 & ~_VALUE != t)):
            return False
    return True


def behind(got: tuple, gen: int) -> list[int]:
    """The ranks whose stamp of operation `gen` is not whole yet."""
    return [r for r in range(len(got) // 4) if not settled((0,) + got[4 * r + 1:4 * r + 4], gen)]


def describe(words: tuple) -> str:
    w0, w1, w2 = words
    gen, op_code, dtype = w0 >> 8, (w0 & 0xFF) // 64, (w0 & 0xFF) % 64
    op = {v: k for k, v in OPS.items()}.get(op_code, f"operation code {op_code}")
    name = str(SUPPORTED_DTYPES[dtype]).replace("torch.", "") if dtype < len(SUPPORTED_DTYPES) else "?"
    return f"#{gen} {op} of {w2 & _VALUE} B {name} (chunk {w1 & _VALUE} B)"
