"""What one client, or many, can make the daemon do: bounded, and told clearly."""

from __future__ import annotations

import re
import socket
import time
from pathlib import Path

from conftest import Raw, store, value

from mqd.testing.daemon import Daemon


def peak_rss_kib(pid: int) -> int:
    """The process's peak resident set (VmHWM), in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM in /proc/<pid>/status")


class Limited(Daemon):
    """A daemon started with a low descriptor limit (soft 200, hard 256)."""

    def command(self) -> list[str]:
        return ["prlimit", "--nofile=200:256", "--", *super().command()]


def test_client_over_max_connections_reads_the_error_line(tmp_path: Path) -> None:
    with Daemon(tmp_path, config_text="[server]\nmax_connections = 1\n") as d:
        first = Raw(d.address)
        first.call(b"version\r\n", b"VERSION 1.0.0\r\n")
        for _ in range(5):
            extra = Raw(d.address)
            # Commands sent before the refusal are read, not left to reset the line.
            extra.send(b"version\r\n" * 2000)
            assert extra.read_until(b"\r\n") == b"ERROR Too many open connections\r\n"
            assert extra.closed()
            extra.close()
        first.call(b"version\r\n", b"VERSION 1.0.0\r\n")
    assert d.log().count("refused a connection") == 1  # repeated refusals: one line


def test_descriptor_limit_caps_connections_and_clients_get_an_answer(tmp_path: Path) -> None:
    with Limited(tmp_path, backend="bdb") as d:
        assert "max_connections lowered from 4096 to" in d.log()
        clients = []
        outcomes = {"served": 0, "refused": 0}
        for _ in range(400):
            try:
                conn = Raw(d.address, timeout=10)
            except OSError:  # the client side runs out first on a small machine: stop there
                break
            clients.append(conn)
            conn.send(b"version\r\n")
        for conn in clients:
            line = conn.read_until(b"\r\n")  # every client gets an answer, none hangs
            if line == b"VERSION 1.0.0\r\n":
                outcomes["served"] += 1
            else:
                assert line == b"ERROR Too many open connections\r\n"
                outcomes["refused"] += 1
        # bdb keeps an eighth of the limit for its queues' files (max_open_queues).
        assert outcomes["served"] >= 50 and outcomes["refused"] > 0, outcomes
        for conn in clients:
            conn.close()
        time.sleep(0.5)
        conn = Raw(d.address)
        store(conn, "fd", b"still here")
        conn.call(b"get fd\r\n", value("fd", b"still here") + b"END\r\n")
    log = d.log()
    assert len(log) < 5000, log[-2000:]
    assert "Traceback" not in log and "PANIC" not in log


def test_connections_leave_descriptors_for_the_queues_files(tmp_path: Path) -> None:
    """With every connection the limit allows open, each pipelining sets into new
    queues, Berkeley DB is never left without a descriptor (it panics then)."""
    with Limited(tmp_path, backend="bdb") as d:
        log = d.log()
        assert (
            "storage.bdb.max_open_queues lowered from 256 to 8 and max_batch from 512 to 8" in log
        )
        found = re.search(r"max_connections lowered from 4096 to (\d+)", log)
        assert found is not None, log
        clients = [Raw(d.address) for _ in range(int(found.group(1)))]
        for i, conn in enumerate(clients):  # rounds that each open many queues' files
            conn.send(b"".join(b"set new%d.%d 0 0 1\r\nx\r\n" % (i, j) for j in range(5)))
        for conn in clients:
            assert conn.read(len(b"STORED\r\n") * 5) == b"STORED\r\n" * 5
        clients[0].call(b"get new0.0\r\n", value("new0.0", b"x") + b"END\r\n")
        for conn in clients:
            conn.close()
    log = d.log()
    assert "Traceback" not in log and "PANIC" not in log, log[-2000:]


def test_a_command_trickling_in_is_cut_off(tmp_path: Path) -> None:
    for config in ("[server]\nidle_timeout = 1\n", "[server]\ncommand_timeout = 1\n"):
        with Daemon(tmp_path, config_text=config) as d:
            slow = Raw(d.address)
            start = time.monotonic()
            with_timeout = False
            for byte in b"set slowloris 0 0 100\r\n" + b"x" * 100:
                try:
                    slow.send(bytes([byte]))
                except OSError:
                    with_timeout = True
                    break
                if slow.closed(wait=0.3):
                    with_timeout = True
                    break
            assert with_timeout, config
            assert time.monotonic() - start < 5
            # A client that sends whole commands slower than that is not idle.
            steady = Raw(d.address)
            for _ in range(4):
                steady.call(b"version\r\n", b"VERSION 1.0.0\r\n")
                time.sleep(0.4)


def test_a_connection_cut_off_is_cut_off_once(tmp_path: Path) -> None:
    """Closed for its slow command while its replies wait for it to read: logged once."""
    with Daemon(tmp_path, config_text="[server]\ncommand_timeout = 0.5\n") as d:
        conn = Raw(d.address, timeout=30)
        store(conn, "big", b"x" * 65536)
        conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
        # Replies it does not read, then half a command.
        conn.send(b"get big/peek\r\n" * 200 + b"set late 0 0 5\r\nab")
        # Twenty of the reaper's looks; such lines are logged once per 10 s
        # at most, the next one counting those held back.
        time.sleep(10.5)
        other = Raw(d.address)
        other.send(b"set late 0 0 5\r\nab")
        assert other.closed(wait=3.0)
        conn.close()
    cut = [line for line in d.log().splitlines() if "a command took over" in line]
    assert len(cut) == 2 and "more in the last" not in cut[1], cut


def test_unread_replies_do_not_grow_without_bound(tmp_path: Path) -> None:
    body = b"x" * 65536
    with Daemon(tmp_path) as d:
        conn = Raw(d.address, timeout=30)
        store(conn, "big", body)
        conn.call(b"get big/peek\r\n", value("big/peek", body) + b"END\r\n")
        before = peak_rss_kib(d.pid)
        # 3,000 peeks of a 64 KiB message: 196 MB of replies for 48 KB sent.
        conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
        conn.send(b"get big/peek\r\n" * 3000)
        time.sleep(1.0)  # the client reads nothing for a while
        reply = value("big/peek", body) + b"END\r\n"
        for _ in range(3000):
            assert conn.read(len(reply)) == reply
        grown_mib = (peak_rss_kib(d.pid) - before) / 1024
        assert grown_mib < 40, f"peak RSS grew {grown_mib:.0f} MiB"
        # One line naming the queue thousands of times: 262 MB of reply.
        conn.send(b"get" + b" big/peek" * 4000 + b"\r\n")
        time.sleep(1.0)
        one = value("big/peek", body)
        for _ in range(4000):
            assert conn.read(len(one)) == one
        assert conn.read(5) == b"END\r\n"
        conn.send(b"get" + b" q" * 8193 + b"\r\n")
        assert conn.read_until(b"\r\n") == b"CLIENT_ERROR too many keys (at most 8192)\r\n"
        grown_mib = (peak_rss_kib(d.pid) - before) / 1024
        assert grown_mib < 40, f"peak RSS grew {grown_mib:.0f} MiB"


def test_pipelined_sets_and_gets_on_berkeley_db_answer_in_order(tmp_path: Path) -> None:
    with Daemon(tmp_path, backend="bdb") as d:
        conn = Raw(d.address, timeout=30)
        pipeline = b"".join(
            b"set pq 0 0 %d\r\n%d\r\nget pq\r\n" % (len(b"%d" % i), i) for i in range(200)
        )
        conn.send(pipeline + b"get pq\r\n")
        for i in range(200):
            body = b"%d" % i
            assert conn.read(len(b"STORED\r\n")) == b"STORED\r\n"
            assert conn.read(len(value("pq", body)) + 5) == value("pq", body) + b"END\r\n"
        assert conn.read(5) == b"END\r\n"
        # Under sync = always each reply means "on disk": after a crash, all of
        # it is still true (nothing taken comes back, nothing stored is lost).
        store(conn, "pq", b"kept")
        d.kill()
        d.start()
        conn = Raw(d.address)
        conn.call(b"get pq\r\n", value("pq", b"kept") + b"END\r\n")
        conn.call(b"get pq\r\n", b"END\r\n")
