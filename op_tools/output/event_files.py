"""TensorBoard event files, written on the caller's thread with a CRC-32C computed in a few vectorised passes.

TensorBoard reads a file of records (TFRecord framing): per record its length (uint64, little-endian), the masked
CRC-32C of those 8 bytes, the record (a serialised ``Event``), the masked CRC-32C of the record. Without TensorFlow,
``tensorboard``'s own writer (behind ``torch.utils.tensorboard.SummaryWriter``) computes each CRC in pure Python, one
byte at a time: 1.1 ms for one step of a real-size Llama's figures (7 KB), on a thread that holds the interpreter's
lock all along, so the training thread waits as long. Here a record is cut into blocks of ``BLOCK`` bytes whose
CRCs are table lookups done by numpy at once (a CRC is linear: a block's is the XOR of its bytes' contributions at
their distance from the block's end), joined one block at a time: ~20x less.

The file is named and begun as ``SummaryWriter``'s: ``events.out.tfevents.<time>.<host>.<pid>.<n>``, its first event
the file version.
"""

from __future__ import annotations

import itertools
import os
import socket
import struct
import time
from typing import Any

_POLYNOMIAL = 0x82F63B78  # CRC-32C (Castagnoli), reflected
BLOCK = 256  # bytes whose CRC is computed in one vectorised step
SHORT = 64  # records shorter than this: byte by byte
_tables: dict[str, Any] = {}


def _byte_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ (_POLYNOMIAL if crc & 1 else 0)
        table.append(crc)
    return table


def _prepared() -> dict[str, Any]:
    """The tables, made at the first record: per byte value, its register after one byte (``byte``); per position in
    a block and byte value, its contribution to the block's CRC (``positions``, BLOCK x 256); per byte of a register,
    the register after BLOCK zero bytes (``shift``, 4 x 256: joining the blocks)."""
    if _tables:
        return _tables
    import numpy as np

    byte = np.array(_byte_table(), dtype=np.uint32)

    def zero_byte(registers):  # the registers after one more zero byte (linear in the register)
        return byte[registers & 0xFF] ^ (registers >> 8)

    positions = np.empty((BLOCK, 256), dtype=np.uint32)
    positions[BLOCK - 1] = byte  # the last byte of a block: its table value
    for k in range(BLOCK - 2, -1, -1):
        positions[k] = zero_byte(positions[k + 1])
    shift = (np.arange(256, dtype=np.uint32)[None, :] << (8 * np.arange(4, dtype=np.uint32))[:, None]).astype(np.uint32)
    for _ in range(BLOCK):
        shift = zero_byte(shift)
    _tables.update(np=np, byte=byte.tolist(), positions=positions, rows=np.arange(BLOCK)[None, :],
                   shift=[row.tolist() for row in shift])
    return _tables


def crc32c(data: bytes) -> int:
    """The CRC-32C of ``data`` (initial register and final XOR all ones), as TensorBoard's ``crc32c``."""
    tables = _prepared()
    if len(data) < SHORT:
        crc = 0xFFFFFFFF
        byte = tables["byte"]
        for b in data:
            crc = byte[(crc ^ b) & 0xFF] ^ (crc >> 8)
        return crc ^ 0xFFFFFFFF
    np = tables["np"]
    # An initial register of all ones is the first four bytes complemented, from a register of zeros; zeros put
    # before the data leave a register of zeros as it is: the data is padded in front to whole blocks.
    pad = -len(data) % BLOCK
    padded = np.zeros(pad + len(data), dtype=np.uint8)
    padded[pad:] = np.frombuffer(data, dtype=np.uint8)
    padded[pad:pad + 4] ^= 0xFF
    blocks = np.bitwise_xor.reduce(tables["positions"][tables["rows"], padded.reshape(-1, BLOCK)], axis=1)
    s0, s1, s2, s3 = tables["shift"]
    crc = 0
    for block in blocks.tolist():
        crc = s0[crc & 0xFF] ^ s1[(crc >> 8) & 0xFF] ^ s2[(crc >> 16) & 0xFF] ^ s3[crc >> 24] ^ block
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    """The CRC TensorBoard's records hold: rotated right by 15 bits, plus a constant."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


_files = itertools.count()
FLUSH_SECONDS = 10.0  # a run watched live sees its figures this late at most


class EventFile:
    """One TensorBoard event file in ``folder`` (made if missing), written as events are added; not thread-safe (one
    writer thread adds them)."""

    def __init__(self, folder: str) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2

        self._event, self._summary = event_pb2.Event, summary_pb2.Summary
        os.makedirs(folder, exist_ok=True)
        self.path = os.path.join(folder, f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}."
                                         f"{os.getpid()}.{next(_files)}")
        self._file: Any = open(self.path, "wb")  # noqa: SIM115 - closed by close()
        self._flushed = time.monotonic()
        self._write(self._event(wall_time=time.time(), file_version="brain.Event:2", source_metadata=event_pb2.
                                SourceMetadata(writer="tensorboard.summary.writer.event_file_writer")))
        self._file.flush()

    def add_scalars(self, step: int, scalars: list[tuple[str, float]]) -> None:
        """One event at ``step`` holding every ``(tag, value)``: what ``add_summary`` of ``torch.utils.tensorboard``'s
        ``scalar`` summaries writes."""
        value = self._summary.Value
        self._write(self._event(wall_time=time.time(), step=step, summary=self._summary(
            value=[value(tag=tag, simple_value=v) for tag, v in scalars])))
        if time.monotonic() - self._flushed >= FLUSH_SECONDS:
            self._file.flush()
            self._flushed = time.monotonic()

    def _write(self, event) -> None:
        data = event.SerializeToString()
        header = struct.pack("<Q", len(data))
        self._file.write(header + struct.pack("<I", masked_crc32c(header)) + data +
                         struct.pack("<I", masked_crc32c(data)))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
