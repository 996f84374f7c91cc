"""TensorBoard event files written by op_tools (output/event_files.py): TensorBoard's own framing and CRCs, faster."""

import io
import os
import random
import struct

import pytest

tensorboard = pytest.importorskip("tensorboard", reason="the test extra installs tensorboard (CI has it)")

from tensorboard.compat.proto import event_pb2  # noqa: E402
from tensorboard.compat.tensorflow_stub import pywrap_tensorflow  # noqa: E402
from tensorboard.summary.writer.record_writer import RecordWriter  # noqa: E402

from op_tools.output import event_files  # noqa: E402


def test_the_crc_is_tensorboards_for_every_length():
    rng = random.Random(0)
    lengths = [*range(0, 3 * event_files.BLOCK + 2), *(rng.randint(0, 50_000) for _ in range(200))]
    for n in lengths:
        data = os.urandom(n)
        assert event_files.crc32c(data) == pywrap_tensorflow.crc32c(data), n
        assert event_files.masked_crc32c(data) == pywrap_tensorflow.masked_crc32c(data), n


def test_an_event_file_holds_the_records_tensorboards_writer_writes(tmp_path):
    file = event_files.EventFile(str(tmp_path / "board"))
    scalars = [(f"grad_norm/model.layers.{i}.mlp.up_proj.weight", 0.5 + i / 7) for i in range(200)]
    file.add_scalars(3, scalars)
    file.add_scalars(4, [("loss", float("nan")), ("step_time", 1e-3)])
    file.close()
    with open(file.path, "rb") as f:
        written = f.read()
    records, at = [], 0
    while at < len(written):
        (size,) = struct.unpack("<Q", written[at:at + 8])
        records.append(written[at + 12:at + 12 + size])
        at += 16 + size
    # the same records framed by tensorboard's own RecordWriter, CRCs included: the same bytes
    expected = io.BytesIO()
    writer = RecordWriter(expected)
    for record in records:
        writer.write(record)
    assert written == expected.getvalue()
    events = [event_pb2.Event.FromString(record) for record in records]
    assert [e.step for e in events] == [0, 3, 4] and events[0].file_version == "brain.Event:2"
    values = [(v.tag, v.simple_value) for v in events[1].summary.value]
    assert values == [(tag, pytest.approx(v, rel=1e-7)) for tag, v in scalars]
    # a value as torch.utils.tensorboard's scalar() writes it
    from torch.utils.tensorboard.summary import scalar

    assert events[2].summary.value[1] == scalar("step_time", 1e-3).value[0]
    assert os.path.basename(file.path).startswith("events.out.tfevents.")

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(os.path.dirname(file.path), size_guidance={"scalars": 0})
    board.Reload()  # TensorBoard's reader checks every CRC as it reads
    assert [(e.step, e.value) for e in board.Scalars("step_time")] == [(4, pytest.approx(1e-3))]
