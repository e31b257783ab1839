"""A plain socket client speaking bytes, for byte-for-byte checks of replies."""

from __future__ import annotations

import socket
import time


class Raw:
    """A plain socket speaking bytes, for byte-for-byte replies."""

    def __init__(self, address: tuple[str, int], timeout: float = 5.0) -> None:
        self.sock = socket.create_connection(address, timeout=timeout)
        self.buf = b""

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def read(self, size: int) -> bytes:
        """Exactly `size` bytes (fails on timeout or close)."""
        while len(self.buf) < size:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError(f"closed after {self.buf!r}")
            self.buf += chunk
        out, self.buf = self.buf[:size], self.buf[size:]
        return out

    def read_until(self, end: bytes) -> bytes:
        while end not in self.buf:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError(f"closed after {self.buf!r}")
            self.buf += chunk
        i = self.buf.index(end) + len(end)
        out, self.buf = self.buf[:i], self.buf[i:]
        return out

    def call(self, data: bytes, expect: bytes) -> None:
        """Send `data` and check the next bytes are exactly `expect`."""
        self.send(data)
        assert self.read(len(expect)) == expect

    def quiet(self, wait: float = 0.2) -> bytes:
        """Whatever arrives within `wait` seconds (b"" when nothing does)."""
        self.sock.settimeout(wait)
        try:
            self.buf += self.sock.recv(65536)
        except TimeoutError:
            pass
        finally:
            self.sock.settimeout(5.0)
        out, self.buf = self.buf, b""
        return out

    def closed(self, wait: float = 2.0) -> bool:
        """Whether the server closes the connection within `wait` seconds."""
        deadline = time.monotonic() + wait
        self.sock.settimeout(wait)
        try:
            while time.monotonic() < deadline:
                chunk = self.sock.recv(65536)
                if not chunk:
                    return True
                self.buf += chunk
        except TimeoutError:
            return False
        except ConnectionResetError:
            return True
        return False

    def close(self) -> None:
        self.sock.close()
