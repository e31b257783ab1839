"""Berkeley DB storage for mqd: the `bdb`, `bdb-single` and `bdb-random` backends."""

from pathlib import Path

from mqd import native

#: The modules every queued command runs through, compiled by `mqd build-native`
#: in one run with mqd's own (mqd/native.py; named in the `mqd.native`
#: entry-point group). Compiled, they take about a sixth off the CPU time of a
#: durable pipelined command. Compiled with mqd's, they read and write a
#: Message's fields directly instead of looking each up by name.
NATIVE = native.Native(
    "mqd_bdb",
    Path(__file__).resolve().parent,
    (
        "backend",
        "catalog",
        "deferred",
        "environment",
        "fifo",
        "index",
        "jobs",
        "leases",
        "operations",
        "per_queue",
        "queue_ops",
        "random_set",
        "records",
        "single",
        "space",
        "store",
        "worker",
    ),
    relies_on=(native.MQD.directory,),
)
NATIVE.activate(__path__)

from mqd_bdb.backend import BdbBackend, BdbRandomBackend, BdbSingleBackend  # noqa: E402

__all__ = ["NATIVE", "BdbBackend", "BdbRandomBackend", "BdbSingleBackend"]
