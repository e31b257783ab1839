"""mqd: a message-queue daemon that speaks the memcached text protocol."""

from mqd import native

__version__ = "1.0.0"

# The compiled build of the hot modules, when there is a current one (see mqd/native.py).
native.MQD.activate(__path__)
