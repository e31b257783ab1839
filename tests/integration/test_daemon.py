"""The daemon's life cycle: signals, systemd notification, limits, config errors, CLI."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import Raw, store, value

from mqd.testing.daemon import Daemon


def mqd(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mqd", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


def test_sigterm_with_clients_connected_exits_cleanly(tmp_path: Path) -> None:
    with Daemon(tmp_path) as d:
        idle, waiting, holder = Raw(d.address), Raw(d.address), Raw(d.address)
        store(holder, "jobs", b"a")
        holder.call(b"get jobs/open\r\n", value("jobs/open", b"a") + b"END\r\n")
        waiting.send(b"get other/t=20000\r\n")
        time.sleep(0.2)
        start = time.monotonic()
        assert d.stop(timeout=15) == 0
        assert time.monotonic() - start < 10
        assert waiting.read_until(b"END\r\n") == b"END\r\n"  # the in-flight get was answered
        assert idle.closed()
        assert "stopped" in d.log()
        assert "Traceback" not in d.log()


def test_second_signal_forces_exit(tmp_path: Path) -> None:
    with Daemon(tmp_path, config_text="[server]\nshutdown_timeout = 60\n") as d:
        busy = Raw(d.address)
        store(busy, "q", b"x" * 512 * 1024)
        # A client that reads none of its replies keeps a command in flight: a
        # graceful stop would wait for it for the whole shutdown_timeout.
        busy.send(b"get q/peek\r\n" * 400)
        time.sleep(0.5)
        d.signal(signal.SIGTERM)
        time.sleep(0.5)
        assert d.process is not None and d.process.poll() is None
        d.signal(signal.SIGTERM)
        assert d.process.wait(10) == 1


def test_sighup_applies_changed_max_items(tmp_path: Path) -> None:
    with Daemon(tmp_path, config_text='[queues."h*"]\nmax_items = 1\n') as d:
        conn = Raw(d.address)
        store(conn, "hq", b"1")
        conn.call(b"set hq 0 0 1\r\n2\r\n", b"NOT_STORED\r\n")
        d.config_path.write_text('[queues."h*"]\nmax_items = 3\n')
        d.signal(signal.SIGHUP)
        deadline = time.monotonic() + 5
        while b"reloaded" not in d.log().encode() and time.monotonic() < deadline:
            time.sleep(0.05)
        store(conn, "hq", b"2")
        store(conn, "hq", b"3")
        conn.call(b"set hq 0 0 1\r\n4\r\n", b"NOT_STORED\r\n")
        # A broken file on reload keeps the old settings and the daemon.
        d.config_path.write_text('[queues."h*"]\nmax_items = "lots"\n')
        d.signal(signal.SIGHUP)
        time.sleep(0.3)
        conn.call(b"set hq 0 0 1\r\n4\r\n", b"NOT_STORED\r\n")
        assert "reload failed" in d.log()
        # What is read only at start is said to wait for a restart.
        d.config_path.write_text('[queues."h*"]\nmax_items = 3\n[server]\nidle_timeout = 5\n')
        d.signal(signal.SIGHUP)
        deadline = time.monotonic() + 5
        while "restart only" not in d.log() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "take effect on restart only: server.idle_timeout" in d.log()
        # ...however often it is reloaded, until the restart.
        d.signal(signal.SIGHUP)
        deadline = time.monotonic() + 5
        while d.log().count("restart only") < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert d.log().count("take effect on restart only: server.idle_timeout") == 2


def test_systemd_notification(tmp_path: Path) -> None:
    path = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        sock.settimeout(10)
        d = Daemon(tmp_path, env={"NOTIFY_SOCKET": str(path)}).start()
        try:
            assert sock.recv(64) == b"READY=1"
            d.stop()
            assert sock.recv(64) == b"STOPPING=1"
        finally:
            d.kill()


def test_shutdown_command_when_enabled(tmp_path: Path) -> None:
    with Daemon(tmp_path, config_text="[server]\nallow_shutdown = true\n") as d:
        Raw(d.address).call(b"shutdown\r\n", b"OK\r\n")
        assert d.process is not None and d.process.wait(10) == 0


def test_flush_all(tmp_path: Path) -> None:
    with Daemon(tmp_path) as d:
        conn = Raw(d.address)
        store(conn, "a", b"1")
        store(conn, "b", b"2")
        conn.call(b"flush_all\r\n", b"OK\r\n")
        conn.call(b"get a b\r\n", b"END\r\n")
        conn.call(b"stats queues\r\n", b"END\r\n")
    with Daemon(tmp_path, config_text="[server]\nallow_flush_all = false\n") as d:
        conn = Raw(d.address)
        conn.call(b"flush_all\r\n", b"CLIENT_ERROR flush_all disabled\r\n")
        conn.call(b"flush_all noreply\r\nversion\r\n", b"VERSION 1.0.0\r\n")


def test_max_connections_and_idle_timeout(tmp_path: Path) -> None:
    config = "[server]\nmax_connections = 2\nidle_timeout = 1\n"
    with Daemon(tmp_path, config_text=config) as d:
        first, second = Raw(d.address), Raw(d.address)
        first.call(b"version\r\n", b"VERSION 1.0.0\r\n")
        second.call(b"version\r\n", b"VERSION 1.0.0\r\n")
        third = Raw(d.address)
        assert third.read_until(b"\r\n") == b"ERROR Too many open connections\r\n"
        assert third.closed()
        assert first.closed(wait=4)  # idle for over a second


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('[server]\nport = "x"\n', "server.port = 'x': must be a whole number from 0 to 65535"),
        ('[server]\nlog_level = "loud"\n', "server.log_level = 'loud': must be one of \"debug\""),
        (
            '[queues."a*"]\noverflow = "spill"\n',
            'queues."a*".overflow = \'spill\': must be one of "reject", "drop_oldest"',
        ),
        (
            '[queues."a*"]\nsync = 1\n',
            'queues."a*".sync = 1: must be one of "always", "periodic", "none"',
        ),
        ("[server]\nprot = 1\n", "server.prot = 1: unknown key; known keys: listen, port"),
        ("[server\n", "not valid TOML"),
        (
            "[server]\nmax_connections = 0\n",
            "server.max_connections = 0: must be a whole number from 1 to 9223372036854775807",
        ),
        ('[storage]\nbackend = "nope"\n', "storage.backend = 'nope': unknown backend 'nope'"),
        (
            "[server.redis]\nport = 70000\n",
            "server.redis.port = 70000: must be a whole number from 0 to 65535",
        ),
        ("[server.redis]\nprot = 1\n", "server.redis.prot = 1: unknown key; known keys: listen"),
        ("[server]\nredis = 6379\n", "server.redis = 6379: must be a table"),
        ("[server]\nport = true\n", "server.port = true: must be a whole number from 0 to 65535"),
        # TOML's nan and inf are floats, but neither is a duration.
        (
            '[queues."*"]\nvisibility_timeout = nan\n',
            'queues."*".visibility_timeout = nan: must be a finite number of at least 0.0',
        ),
        ("[server]\nmax_wait = inf\n", "server.max_wait = inf: must be a finite number"),
        (
            "[storage.bdb]\ncheckpoint_s = nan\n",
            "storage.bdb.checkpoint_s = nan: must be a finite number above 0.0",
        ),
        # A dead-letter queue that no client could reach.
        (
            '[queues."*"]\ndead_letter = "bad name"\n',
            'queues."*".dead_letter = \'bad name\': must be "" or a queue name',
        ),
        ('[queues."*"]\ndead_letter = "dl/open"\n', "dead_letter = 'dl/open': must be \"\" or"),
        # Sizes Berkeley DB takes as C ints.
        (
            "[storage.bdb]\nlog_file_mb = 4096\n",
            "storage.bdb.log_file_mb = 4096: must be a whole number from 1 to 2047",
        ),
        (
            "[storage.bdb]\ncache_mb = 9223372036854775807\n",
            "storage.bdb.cache_mb = 9223372036854775807: must be a whole number from 1 to 1048576",
        ),
        (
            "[storage.bdb]\ncache_mb = 1048576\n",
            "storage.bdb.cache_mb = 1048576: must be at most this machine's memory",
        ),
        # An address with its port glued on would fail only at start, naming no key.
        (
            '[server]\nlisten = "127.0.0.1:44010"\n',
            "server.listen = '127.0.0.1:44010': must be an IP address or a host name, without a"
            " port (0.0.0.0: every IPv4 address, ::: every address)",
        ),
        (
            '[server.redis]\nlisten = "::1 6379"\n',
            "server.redis.listen = '::1 6379': must be an IP address or a host name, without",
        ),
        ('[metrics]\nlisten = ""\n', "metrics.listen = '': must be an IP address or a host"),
        ('[server]\nlisten = ""\n', "server.listen = '': must be an IP address or a host"),
        ('[server]\nlisten = "999.1.1.1"\n', "server.listen = '999.1.1.1': must be an IP"),
        # Two listeners on one port.
        (
            "[server]\nport = 44016\n[metrics]\nport = 44016\n",
            "server.port (--port) and metrics.port are both 44016 on 127.0.0.1",
        ),
        # Two spellings of one address.
        (
            '[server]\nlisten = "::1"\nport = 44018\n[metrics]\nlisten = "0:0:0:0:0:0:0:1"\n'
            "port = 44018\n",
            "server.port (--port) and metrics.port are both 44018 on ::1",
        ),
        (
            "[server]\nport = 44016\n[server.redis]\nport = 44016\n",
            "server.port (--port) and server.redis.port (--redis-port) are both 44016",
        ),
        # Larger than a <bytes> the wire carries (memcached's own bound).
        (
            '[queues."*"]\nmax_item_size = 3000000000\n',
            "max_item_size = 3000000000: must be a whole number from 1 to 1073741824",
        ),
    ],
)
def test_bad_config_names_file_key_value_and_allowed(
    tmp_path: Path, text: str, expected: str
) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    for command in ("check-config", "serve"):
        result = mqd(command, "--config", str(path))
        assert result.returncode != 0
        assert str(path) in result.stderr and expected in result.stderr
        assert "Traceback" not in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1


def test_a_config_that_is_not_utf8_gets_the_same_one_line(tmp_path: Path) -> None:
    path = tmp_path / "latin1.toml"
    path.write_bytes(b'[server]\nlog_level = "d\xe9bug"\n')
    for command in ("check-config", "serve"):
        result = mqd(command, "--config", str(path))
        assert result.returncode != 0
        assert result.stderr.strip() == (
            f"Error: {path}: not valid TOML: byte 0xe9 at offset 23 is not UTF-8 text,"
            " which TOML files must be"
        )


@pytest.mark.parametrize(
    ("backend", "name", "says"),
    [
        ("memory", "daemon-id", "it holds this daemon's id"),
        ("bdb", "daemon-id", "it holds this daemon's id"),
        ("bdb", "layout", "it names the backend that wrote this directory"),
    ],
)
def test_a_data_dir_file_that_is_not_utf8_gets_one_line(
    tmp_path: Path, backend: str, name: str, says: str
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / name).write_bytes(b"\xff\xfe\x00\n")
    result = mqd("serve", "--backend", backend, "--data-dir", str(data), "--port", "0")
    assert result.returncode == 1
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("Error: ") and f"{data / name}: not UTF-8 text; {says}" in line


def test_a_config_that_is_a_directory_gets_the_same_one_line(tmp_path: Path) -> None:
    for command in ("check-config", "serve"):
        result = mqd(command, "--config", str(tmp_path))
        assert result.returncode == 1
        assert result.stderr.strip() == f"Error: {tmp_path}: cannot read: Is a directory"


@pytest.mark.parametrize(
    ("args", "env", "expected"),
    [
        (["--port", "99999"], {}, "--port = 99999: must be a whole number from 0 to 65535"),
        (["--port", "-5"], {}, "--port = -5: must be a whole number from 0 to 65535"),
        (["--port", "x"], {}, "--port = 'x': must be a whole number from 0 to 65535"),
        ([], {"MQD_PORT": "99999"}, "MQD_PORT = 99999: must be a whole number from 0 to 65535"),
        (["--redis-port", "x"], {}, "--redis-port = 'x': must be a whole number from 0 to 65535"),
        ([], {"MQD_REDIS_PORT": "-1"}, "MQD_REDIS_PORT = -1: must be a whole number from 0 to"),
        (["--loop", "fast"], {}, '--loop = \'fast\': must be one of "asyncio", "uvloop"'),
        ([], {"MQD_LOG_LEVEL": "loud"}, "MQD_LOG_LEVEL = 'loud': must be one of \"debug\""),
        ([], {"MQD_BACKEND": "nope"}, "MQD_BACKEND = 'nope': unknown backend 'nope'"),
        (["--port", "+-5"], {}, "--port = '+-5': must be a whole number from 0 to 65535"),
        (["--port", "\u00b2"], {}, "--port = '\u00b2': must be a whole number from 0 to 65535"),
        ([], {"MQD_PORT": "-+1"}, "MQD_PORT = '-+1': must be a whole number from 0 to 65535"),
        (
            ["--listen", "127.0.0.1:44010"],
            {},
            "--listen = '127.0.0.1:44010': must be an IP address or a host name, without a port",
        ),
        ([], {"MQD_LISTEN": "-bad-"}, "MQD_LISTEN = '-bad-': must be an IP address or a host"),
        (
            ["--port", "44017", "--redis-port", "44017"],
            {},
            "server.port (--port) and server.redis.port (--redis-port) are both 44017",
        ),
    ],
)
def test_flags_and_environment_are_validated_like_the_file(
    args: list[str], env: dict[str, str], expected: str
) -> None:
    backend = [] if "MQD_BACKEND" in env else ["--backend", "memory"]
    result = mqd("serve", *backend, *args, env=env)
    assert result.returncode != 0
    assert result.stderr.strip() == f"Error: {expected}" or expected in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


@pytest.mark.parametrize(
    ("listen", "shown"),
    [
        ("::1", "[::1]:22133"),
        ("0.0.0.0", "0.0.0.0:22133"),
        ("mq-1.example.com", "mq-1.example.com:22133"),
    ],
)
def test_listen_takes_an_address_or_a_host_name(tmp_path: Path, listen: str, shown: str) -> None:
    path = tmp_path / "listen.toml"
    path.write_text(f'[server]\nlisten = "{listen}"\n[storage]\nbackend = "memory"\n')
    result = mqd("check-config", "--config", str(path))
    assert result.returncode == 0, result.stderr
    assert f"listen {shown}, backend memory" in result.stdout


def test_data_dir_default_is_the_same_in_help_and_example() -> None:
    example = (Path(__file__).parents[2] / "etc" / "mqd.toml").read_text()
    help_text = " ".join(mqd("serve", "--help").stdout.split())
    assert "[default: data; etc/mqd.toml sets /var/lib/mqd]" in help_text
    assert 'data_dir = "/var/lib/mqd"' in example
    assert 'The default is "data"' in example


def test_unknown_backend_suggests_the_nearest(tmp_path: Path) -> None:
    result = mqd("serve", "--backend", "memroy", "--port", "0")
    assert result.returncode != 0
    assert "unknown backend 'memroy'" in result.stderr and "did you mean 'memory'" in result.stderr


def test_check_config_accepts_the_shipped_example(tmp_path: Path) -> None:
    example = Path(__file__).parents[2] / "etc" / "mqd.toml"
    result = mqd("check-config", "--config", str(example))
    assert result.returncode == 0, result.stderr
    assert "OK" in result.stdout


def test_backends_lists_the_built_in_one() -> None:
    result = mqd("backends")
    assert result.returncode == 0
    line = next(line for line in result.stdout.splitlines() if "memory" in line)
    assert "mqd" in line and "unique" in line and "fifo" in line


def test_flags_and_environment_override_the_file(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text("[server]\nport = 1\n")
    port = str(Daemon(tmp_path).port)
    proc = subprocess.Popen(
        [sys.executable, "-m", "mqd", "serve", "--config", str(config), "--backend", "memory"],
        env={**os.environ, "MQD_PORT": port},
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                Raw(("127.0.0.1", int(port))).call(b"version\r\n", b"VERSION 1.0.0\r\n")
                break
            except OSError:
                time.sleep(0.05)
        else:
            pytest.fail("daemon did not listen on the MQD_PORT port")
    finally:
        proc.terminate()
        assert proc.wait(10) == 0


def test_stats_command_prints_tables(daemon: Daemon, q: str) -> None:
    store(Raw(daemon.address), q, b"abc")
    result = mqd("stats", "--port", str(daemon.port))
    assert result.returncode == 0, result.stderr
    row = next(line for line in result.stdout.splitlines() if q in line)
    assert row.split("│")[2].strip() == "1"  # items
    assert mqd("stats", "--port", "1").returncode != 0


def test_stats_command_keeps_the_figures_beside_a_name_wider_than_the_table(
    daemon: Daemon, q: str
) -> None:
    long = "n" * 250  # the longest name there is, with COLUMNS=80
    store(Raw(daemon.address), long, b"abc")
    for body in (b"a", b"b"):
        store(Raw(daemon.address), q, body)
    result = mqd("stats", "--port", str(daemon.port), env={"COLUMNS": "80"})
    assert result.returncode == 0, result.stderr
    # To a pipe, each name whole on its line, beside its figures.
    rows = [line.split("│") for line in result.stdout.splitlines() if line.count("│") > 2]
    items = {cells[1].strip(): cells[2].strip() for cells in rows}
    assert (items[long], items[q]) == ("1", "2")


def test_client_commands_say_why_a_port_gave_no_reply() -> None:
    """A port that closes at once (TLS, HTTP) gives pymemcache an error with no text."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]

        def refuse() -> None:
            for _ in range(2):
                connection, _ = listener.accept()
                connection.recv(100)  # the command, read (no reset), never answered
                connection.close()

        threading.Thread(target=refuse, daemon=True).start()
        for command in (["stats"], ["redrive", "graveyard"]):
            result = mqd(*command, "--port", str(port))
            assert result.returncode == 1
            assert "the connection closed without a memcached reply" in result.stderr


def test_backend_options_errors_name_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[storage.bdb]\ncache_mb = -1\n")
    result = mqd("check-config", "--config", str(path))
    assert result.returncode != 0
    assert f"{path}: storage.bdb.cache_mb = -1: must be a whole number from 1" in result.stderr
    # Each table belongs to the backend of its name; another backend ignores it.
    path.write_text('[storage]\nbackend = "bdb-single"\n[storage.bdb]\ncache_mb = -1\n')
    assert mqd("check-config", "--config", str(path)).returncode == 0


def test_flush_all_with_a_delay_keeps_one_pending_flush(tmp_path: Path) -> None:
    with Daemon(tmp_path) as d:
        conn = Raw(d.address)
        conn.call(b"flush_all 1\r\n" * 1000, b"OK\r\n" * 1000)
        # As memcached: a later flush_all replaces the pending one.
        conn.call(b"flush_all 60\r\n", b"OK\r\n")
        store(conn, "kept", b"1")
        time.sleep(1.5)
        conn.call(b"get kept\r\n", value("kept", b"1") + b"END\r\n")
        conn.call(b"flush_all 1\r\n", b"OK\r\n")
        store(conn, "gone", b"1")
        time.sleep(1.5)
        conn.call(b"get gone\r\n", b"END\r\n")
        conn.call(b"flush_all 60\r\n", b"OK\r\n")
        # Over 30 days the delay is a Unix time, as an exptime is: a past one is now.
        store(conn, "past", b"1")
        conn.call(b"flush_all 1700000000\r\n", b"OK\r\n")
        conn.call(b"get past\r\n", b"END\r\n")
        # ...flushed before its reply: a set pipelined behind it stays.
        conn.call(b"flush_all 2592001\r\nset kept 0 0 1\r\nx\r\n", b"OK\r\nSTORED\r\n")
        time.sleep(0.2)
        conn.call(b"get kept\r\n", value("kept", b"x") + b"END\r\n")
        assert d.stop() == 0
    assert "never awaited" not in d.log()


def test_timeouts_however_short_leave_the_daemon_idle(tmp_path: Path) -> None:
    config = "[server]\ncommand_timeout = 1e-9\nidle_timeout = 1e-9\n"
    with Daemon(tmp_path, config_text=config) as d:
        before = _cpu_seconds(d.pid)
        time.sleep(1)
        assert _cpu_seconds(d.pid) - before < 0.5  # it spun at a whole core before


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_storage_error_at_start_names_the_data_dir() -> None:
    # /sys refuses new directories even to root: a storage error without a path.
    data_dir = "/sys/mqd-test-data"
    result = mqd("serve", "--backend", "bdb", "--port", "0", "--data-dir", data_dir)
    assert result.returncode != 0
    assert result.stderr.strip().startswith(f"Error: {data_dir}: "), result.stderr
    assert "Traceback" not in result.stderr
