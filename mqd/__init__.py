"""mqd: a message-queue daemon that speaks the memcached text protocol."""

__version__ = "0.1.0"
