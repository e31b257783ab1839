"""Named leases on the memory backend, through a real daemon."""

from mqd.testing.leases import LeaseConformance
from mqd.testing.raw import Raw


class TestMemoryLeases(LeaseConformance):
    backend = "memory"

    def test_a_lease_stops_at_64_mib_of_bodies(self, conn: Raw) -> None:
        queue = self.name()
        body = b"x" * (1 << 20)
        for _ in range(66):
            conn.call(b"set %b 0 0 %d\r\n%b\r\n" % (queue.encode(), len(body), body), b"STORED\r\n")
        # The message that brings the bodies to 64 MiB is the last one reserved.
        held = self.lease(conn, queue, "huge", 100)
        assert [i for i, _ in held] == list(range(64))
        assert self.lease(conn, queue, "huge", 100) == held
        assert self.ack(conn, queue, "huge", to=0) == b"DELETED\r\n"
        # Room again: one more, which reaches the bound again.
        assert [i for i, _ in self.lease(conn, queue, "huge", 100)] == list(range(1, 65))
        assert self.ack(conn, queue, "huge") == b"DELETED\r\n"
        assert [i for i, _ in self.lease(conn, queue, "huge", 100)] == [65]
        self.abort(conn, queue, "huge")
