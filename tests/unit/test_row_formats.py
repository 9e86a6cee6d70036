"""Row formats of snapshot records through the writer's conversion, a local read and the
stream: a log whose publishes wrote native, float16 and int8 records (by
:func:`persistent_delta.trainer.publish.formatted_records`, the writer's own step), shipped
through the in-process memory transport; each reader, local or remote, gets exactly its
format's rows, and the remote ones equal the local ones bit for bit."""

from __future__ import annotations

import os
import time

import torch

from persistent_delta.fleet.memory import MemoryBroker
from persistent_delta.fleet.remote import RemoteConsumer
from persistent_delta.fleet.ship import Shipper
from persistent_delta.log import codec
from persistent_delta.log.deltalog import DeltaLog
from persistent_delta.log.schema import META_SNAPSHOT_END, SNAPSHOTS, ConsumerEntry
from persistent_delta.read.consumer import DeltaReader
from persistent_delta.trainer.publish import Captured, formatted_records

JOB, DIM, ROWS = "job-formats", 8, 64


def _publish_log(path: str) -> torch.Tensor:
    """Three publishes of table ``t`` (native, float16 and int8 records each); returns the
    table's values at the last one."""
    table = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(3))
    with DeltaLog(path) as log:
        def setup(w):
            e = w.ensure_table("t")
            e.values_dtype, e.values_tail = "float32", [DIM]
            w.stage_table(e)
        log.write(setup)
        for stamp in (1, 2, 3):
            table[stamp * 5:stamp * 5 + 9] += 0.5  # rows change between publishes
            ids = torch.arange(stamp * 5, stamp * 5 + 9 + stamp)
            cap = Captured("serving", ConsumerEntry(0), stamp + 1, stamp, time.time(),
                           formats=("native", "float16", "int8"))
            value = codec.encode_gathered(ids, table, ids, codec.KIND_SNAPSHOT, cap.publish_time, checksum=False)

            def put(w, value=value, stamp=stamp, cap=cap):
                for rec in formatted_records(cap, "t", value):
                    w.put_record(w.table("t").table_id, stamp, rec, channel=SNAPSHOTS)
                w.set_meta(META_SNAPSHOT_END, stamp + 1)
            log.write(put)
    return table


def test_each_reader_gets_its_format_locally_and_through_the_stream(tmp_path):
    root = str(tmp_path / "log")
    table = _publish_log(os.path.join(root, "rank-0"))
    touched = torch.arange(5, 5 * 3 + 9 + 3)
    want = {"native": table[touched], "float32": table[touched], "float16": table[touched].half(),
            "int8": codec.quantize_int8(table[touched])}
    local = {}
    for fmt, rows in want.items():
        with DeltaReader(root, channel=SNAPSHOTS, format=fmt) as r:
            poll = r.poll()
            (t,), = poll.tables().values()
            assert t.format == fmt and torch.equal(t.global_ids, touched) and torch.equal(t.states, rows), fmt
            assert poll.passed_over == 6  # 3 publishes x the 2 other records
            local[fmt] = poll
    broker = MemoryBroker()
    with Shipper(root, None, JOB, channels=["snapshots"], transport=broker.connect("shipper"), insecure=True) as s:
        s.run(idle_exit_s=0.2)
        assert all(not st["last_error"] for st in s.stats()), s.stats()
    for fmt in ("int8", "float16", "float32"):
        with RemoteConsumer(None, JOB, f"replica-{fmt}", channel=SNAPSHOTS, format=fmt, wait=5, insecure=True,
                            transport=broker.connect(fmt)) as c:
            got = c.poll()
            (t,), = got.tables().values()
            (w,), = local[fmt].tables().values()
            assert got.format == t.format == fmt and got.passed_over > 0
            assert torch.equal(t.global_ids, w.global_ids) and torch.equal(t.states, w.states), fmt
