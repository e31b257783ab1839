"""Named leases on the memory backend, through a real daemon."""

from mqd.testing.leases import LeaseConformance


class TestMemoryLeases(LeaseConformance):
    backend = "memory"
