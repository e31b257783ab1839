"""The backends that come with mqd; plugins add theirs through the `mqd.backends` entry points."""

from mqd import native

# The memory backend is compiled with mqd's hot modules (mqd/native.py).
native.MQD.activate_subpackage("backends", __path__)
