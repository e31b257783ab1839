"""TLS and memcached-style authentication against real clients."""

from __future__ import annotations

import os
import shutil
import socket
import ssl
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
from conftest import Raw
from pymemcache.client.base import Client
from pymemcache.exceptions import MemcacheClientError, MemcacheUnexpectedCloseError

from mqd.security import Authenticator
from mqd.testing.daemon import Daemon

needs_openssl = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")


@dataclass
class Certs:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, all made here."""
    d = tmp_path_factory.mktemp("certs")
    ca_key, ca = d / "ca.key", d / "ca.pem"
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-subj",
        "/CN=mqd test CA",
        "-keyout",
        str(ca_key),
        "-out",
        str(ca),
    )
    made = {}
    for name, extension in (("server", "subjectAltName=IP:127.0.0.1"), ("client", "")):
        key, csr, cert = d / f"{name}.key", d / f"{name}.csr", d / f"{name}.pem"
        _openssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            f"/CN={name}",
            "-keyout",
            str(key),
            "-out",
            str(csr),
        )
        ext = d / f"{name}.ext"
        ext.write_text(extension + "\n" if extension else "basicConstraints=CA:FALSE\n")
        _openssl(
            "x509",
            "-req",
            "-in",
            str(csr),
            "-CA",
            str(ca),
            "-CAkey",
            str(ca_key),
            "-CAcreateserial",
            "-days",
            "2",
            "-out",
            str(cert),
            "-extfile",
            str(ext),
        )
        made[name] = (cert, key)
    return Certs(ca, *made["server"], *made["client"])


def tls_config(certs: Certs, mutual: bool = False) -> str:
    text = f'[server.tls]\ncert_file = "{certs.server_cert}"\nkey_file = "{certs.server_key}"\n'
    return text + (f'ca_file = "{certs.ca}"\n' if mutual else "")


def client_context(certs: Certs, with_cert: bool = False) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(certs.ca))
    if with_cert:
        context.load_cert_chain(certs.client_cert, certs.client_key)
    return context


@pytest.fixture(scope="module")
def tls_daemon(tmp_path_factory: pytest.TempPathFactory, certs: Certs) -> Iterator[Daemon]:
    with Daemon(tmp_path_factory.mktemp("tls"), config_text=tls_config(certs)) as d:
        yield d


@needs_openssl
def test_pymemcache_over_tls(tls_daemon: Daemon, certs: Certs) -> None:
    client = Client(tls_daemon.address, tls_context=client_context(certs), timeout=10)
    assert client.set("tlsq", b"secret", noreply=False) is True
    assert client.get("tlsq") == b"secret"
    assert client.get("tlsq") is None
    client.close()
    # A plain-text client gets no reply: the daemon only speaks TLS here.
    plain = Raw(tls_daemon.address, timeout=5)
    plain.send(b"version\r\n")
    assert b"VERSION" not in plain.quiet(1.0)
    plain.close()


@needs_openssl
def test_openssl_s_client(tls_daemon: Daemon, certs: Certs) -> None:
    result = subprocess.run(
        [
            "openssl",
            "s_client",
            "-connect",
            f"127.0.0.1:{tls_daemon.port}",
            "-CAfile",
            str(certs.ca),
            "-verify_return_error",
            "-quiet",
            "-crlf",
        ],
        input=b"set viaopenssl 0 0 2\nhi\nget viaopenssl\nquit\n",
        capture_output=True,
        timeout=30,
    )
    assert b"STORED\r\nVALUE viaopenssl 0 2\r\nhi\r\nEND\r\n" in result.stdout, result.stderr


@needs_openssl
def test_mutual_tls_needs_a_client_certificate(tmp_path: Path, certs: Certs) -> None:
    with Daemon(tmp_path, config_text=tls_config(certs, mutual=True)) as d:
        client = Client(d.address, tls_context=client_context(certs, with_cert=True), timeout=10)
        assert client.set("mtls", b"1", noreply=False) is True
        assert client.get("mtls") == b"1"
        client.close()
        anonymous = Client(d.address, tls_context=client_context(certs), timeout=5)
        # TLS 1.3 ends the handshake before the server checks: then it closes.
        with pytest.raises((ssl.SSLError, OSError, MemcacheUnexpectedCloseError)):
            anonymous.set("mtls", b"2", noreply=False)
        assert "Traceback" not in d.log()


@needs_openssl
def test_bad_tls_files_are_config_errors(tmp_path: Path, certs: Certs) -> None:
    config = tmp_path / "mqd.toml"
    cases = {
        f'[server.tls]\ncert_file = "{tmp_path}/none.pem"\nkey_file = "{certs.server_key}"\n': (
            "server.tls.cert_file = "
        ),
        f'[server.tls]\ncert_file = "{certs.server_cert}"\nkey_file = "{certs.client_key}"\n': (
            "server.tls: cannot use"
        ),
        f'[server.tls]\ncert_file = "{certs.server_cert}"\n': "server.tls.key_file: missing",
    }
    for text, expected in cases.items():
        config.write_text(text)
        for command in ("check-config", "serve"):
            result = subprocess.run(
                [sys.executable, "-m", "mqd", command, "-c", str(config)]
                + ([] if command == "check-config" else ["--port", "0", "--backend", "memory"]),
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert result.returncode != 0
            assert expected in result.stderr and str(config) in result.stderr, result.stderr
            assert len(result.stderr.strip().splitlines()) == 1


# -- authentication -------------------------------------------------------------


@pytest.fixture(scope="module")
def auth_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = tmp_path_factory.mktemp("auth")
    users = d / "users"
    users.write_text("alice:s3cret pass\nbob:hunter2\n")
    with Daemon(d, config_text=f'[server.auth]\nusers_file = "{users}"\n') as daemon:
        yield daemon


def test_commands_before_login_are_refused(auth_daemon: Daemon) -> None:
    conn = Raw(auth_daemon.address)
    conn.call(b"version\r\n", b"CLIENT_ERROR unauthenticated\r\n")
    conn.call(b"get q\r\n", b"CLIENT_ERROR unauthenticated\r\n")
    conn.call(b"add x 0 0 3\r\nbob\r\n", b"CLIENT_ERROR unauthenticated\r\n")
    conn.call(b"set x 0 0 3\r\nbob\r\n", b"CLIENT_ERROR bad authentication token format\r\n")
    conn.call(b"set x 0 0 9\r\nbob wrong\r\n", b"CLIENT_ERROR authentication failure\r\n")
    conn.call(b"set x 0 0 10\r\nbob hunter\r\n", b"CLIENT_ERROR authentication failure\r\n")
    conn.call(b"version\r\n", b"CLIENT_ERROR unauthenticated\r\n")
    # The password is everything after the first space, spaces included.
    conn.call(b"set x 0 0 17\r\nalice s3cret pass\r\n", b"STORED\r\n")
    conn.call(b"version\r\n", b"VERSION 1.0.0\r\n")
    conn.call(
        b"set authq 0 0 1\r\n1\r\nget authq\r\n", b"STORED\r\nVALUE authq 0 1\r\n1\r\nEND\r\n"
    )
    # Each connection logs in for itself.
    Raw(auth_daemon.address).call(b"get authq\r\n", b"CLIENT_ERROR unauthenticated\r\n")


def test_a_login_under_noreply_answers_nothing(auth_daemon: Daemon) -> None:
    conn = Raw(auth_daemon.address)
    conn.send(b"set x 0 0 9 noreply\r\nbob wrong\r\ndelete q noreply\r\n")
    conn.send(b"set x 0 0 17 noreply\r\nalice s3cret pass\r\n")
    conn.call(b"version\r\n", b"VERSION 1.0.0\r\n")  # the first reply of all


def test_pymemcache_logs_in_with_a_set(auth_daemon: Daemon) -> None:
    client = Client(auth_daemon.address, timeout=10)
    with pytest.raises(MemcacheClientError, match="unauthenticated"):
        client.get("pq")
    with pytest.raises(MemcacheClientError, match="authentication failure"):
        client.set("auth", b"bob nope", noreply=False)
    assert client.set("auth", b"bob hunter2", noreply=False) is True
    assert client.set("pq", b"job", noreply=False) is True
    assert client.get("pq") == b"job"
    client.close()


@needs_openssl
def test_login_over_tls(tmp_path: Path, certs: Certs) -> None:
    users = tmp_path / "users"
    users.write_text("carol:pw\n")
    config = tls_config(certs) + f'[server.auth]\nusers_file = "{users}"\n'
    with Daemon(tmp_path, config_text=config) as d:
        client = Client(d.address, tls_context=client_context(certs), timeout=10)
        assert client.set("auth", b"carol pw", noreply=False) is True
        assert client.set("both", b"1", noreply=False) is True
        assert client.get("both") == b"1"
        client.close()


def _mqd_command(*args: str, password: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "MQD_PASSWORD"}
    if password is not None:
        env["MQD_PASSWORD"] = password
    return subprocess.run(
        [sys.executable, "-m", "mqd", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        stdin=subprocess.DEVNULL,
    )


@needs_openssl
def test_stats_and_redrive_reach_a_daemon_with_mutual_tls_and_logins(
    tmp_path: Path, certs: Certs
) -> None:
    users = tmp_path / "users"
    users.write_text("carol:pw two\n")
    config = tls_config(certs, mutual=True) + f'[server.auth]\nusers_file = "{users}"\n'
    with Daemon(tmp_path, config_text=config) as d:
        client = Client(d.address, tls_context=client_context(certs, with_cert=True), timeout=10)
        assert client.set("auth", b"carol pw two", noreply=False) is True
        for body in (b"a", b"b", b"c"):
            assert client.set("parked", body, noreply=False) is True
        port = ["--port", str(d.port)]
        tls = ["--ca-file", str(certs.ca), "--cert-file", str(certs.client_cert)]
        tls += ["--key-file", str(certs.client_key)]
        shown = _mqd_command("stats", *port, *tls, "--user", "carol", password="pw two")
        assert shown.returncode == 0, shown.stderr
        assert "parked" in shown.stdout and "curr_connections" in shown.stdout
        moved = _mqd_command(
            "redrive", "parked", "--to", "back", *port, *tls, "--user", "carol", password="pw two"
        )
        assert moved.returncode == 0, moved.stderr
        assert "moved 3 message(s) from parked to back" in moved.stdout
        assert [client.get("back") for _ in range(4)] == [b"a", b"b", b"c", None]
        client.close()
        # Each way of getting it wrong says what is wrong, in one line.
        at = f"127.0.0.1:{d.port}"
        wrong: dict[tuple[str, ...], str | tuple[str, ...]] = {
            (*port, *tls): "the daemon asks clients to log in: give --user (and MQD_PASSWORD)",
            (*port, *tls, "--user", "carol", "--password", "nope"): (
                f"cannot log in to {at} as 'carol': authentication failure"
            ),
            (*port, "--user", "carol", "--password", "pw two"): (
                "the connection closed without a memcached reply (a TLS or HTTP port?)"
            ),
            (*port, "--tls", "--user", "carol", "--password", "pw two"): (
                f"cannot log in to {at} as 'carol': TLS: CERTIFICATE_VERIFY_FAILED"
            ),
            (*port, *tls, "--user", "carol"): "--user carol needs a password: set MQD_PASSWORD",
            (*port, "--key-file", str(certs.client_key)): "--key-file goes with --cert-file",
            (*port, "--cert-file", str(certs.client_cert)): (
                f"--cert-file {certs.client_cert}: cannot use it (is its key in it? if not, give"
                " --key-file)"
            ),
            (*port, "--ca-file", str(users)): f"--ca-file {users}: no CA certificate (PEM) there",
            # The daemon's refusal comes as a close, or as TLS 1.3's alert if it
            # arrives before the client's first read.
            (*port, "--ca-file", str(certs.ca), "--user", "carol", "--password", "pw two"): (
                f"cannot log in to {at} as 'carol': the daemon closed the connection after the"
                " TLS handshake: it asks for a client certificate (--cert-file), or refused the"
                " one given",
                f"cannot log in to {at} as 'carol': TLS: TLSV13_ALERT_CERTIFICATE_REQUIRED",
            ),
        }
        for args, expected in wrong.items():
            for command in (["stats"], ["redrive", "parked"]):
                result = _mqd_command(*command, *args)
                assert result.returncode != 0
                either = (expected,) if isinstance(expected, str) else expected
                assert any(text in result.stderr for text in either), (args, result.stderr)
                assert len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert "Traceback" not in d.log()


def test_a_login_goes_only_to_a_daemon_that_asks_for_one(daemon: Daemon) -> None:
    # To one that does not, the login's `set` would store the password as a message.
    shown = _mqd_command("stats", "--port", str(daemon.port), "--user", "carol", password="pw")
    assert shown.returncode == 0, shown.stderr
    assert "mqd-login" not in shown.stdout
    Raw(daemon.address).call(b"get mqd-login\r\n", b"END\r\n")


@pytest.mark.skipif(shutil.which("memccp") is None, reason="needs libmemcached-tools")
def test_libmemcached_tools(auth_daemon: Daemon, tmp_path: Path) -> None:
    servers = f"--servers=127.0.0.1:{auth_daemon.port}"
    message = tmp_path / "toolq"
    message.write_bytes(b"from memccp")
    # --username/--password are SASL, which libmemcached speaks only over the
    # binary protocol: refused before anything is sent.
    sasl = subprocess.run(
        ["memccp", servers, "--username=bob", "--password=hunter2", str(message)],
        capture_output=True,
        timeout=30,
    )
    assert sasl.returncode != 0 and b"not supported via the ASCII protocol" in sasl.stderr
    # Without logging in, the set is refused.
    assert subprocess.run(["memccp", servers, str(message)], timeout=30).returncode != 0
    # memccp copies every file over one connection: a first file holding
    # "<user> <password>" is the login set, as memcached's text protocol wants.
    login = tmp_path / "login"
    login.write_bytes(b"bob hunter2")
    subprocess.run(["memccp", servers, str(login), str(message)], check=True, timeout=30)
    client = Client(auth_daemon.address, timeout=10)
    client.set("auth", b"alice s3cret pass", noreply=False)
    assert client.get("toolq") == b"from memccp"
    client.close()


def test_authenticator_compares_every_entry() -> None:
    auth = Authenticator({b"a": b"1", b"b": b"2"})
    assert auth.check(b"a", b"1") and auth.check(b"b", b"2")
    assert not auth.check(b"a", b"2") and not auth.check(b"c", b"1") and not auth.check(b"", b"")


def test_bad_users_file_is_a_config_error(tmp_path: Path) -> None:
    users = tmp_path / "users"
    config = tmp_path / "mqd.toml"
    config.write_text(f'[server.auth]\nusers_file = "{users}"\n')
    for content, expected in ((None, "cannot read"), ("nocolon\n", "line 1 is not user:password")):
        if content is not None:
            users.write_text(content)
        result = subprocess.run(
            [sys.executable, "-m", "mqd", "check-config", "-c", str(config)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode != 0
        assert f"server.auth.users_file = '{users}'" in result.stderr
        assert expected in result.stderr


def test_unauthenticated_flood_is_bounded(auth_daemon: Daemon) -> None:
    conn = Raw(auth_daemon.address, timeout=10)
    conn.send(b"get q\r\n" * 5000)
    expected = b"CLIENT_ERROR unauthenticated\r\n" * 5000
    assert conn.read(len(expected)) == expected
    with socket.create_connection(auth_daemon.address, timeout=5) as sock:
        sock.sendall(b"set x 0 0 11\r\nbob hunter2\r\nversion\r\n")
        assert sock.recv(100).startswith(b"STORED\r\n")


# -- the Redis listener: the same TLS and users ------------------------------------


@needs_openssl
def test_redis_py_over_tls(tmp_path: Path, certs: Certs) -> None:
    with Daemon(tmp_path, config_text=tls_config(certs), redis=True) as d:
        host, port = d.redis_address
        client = redis.Redis(
            host=host, port=port, ssl=True, ssl_ca_certs=str(certs.ca), socket_timeout=10
        )
        assert client.lpush("tlsq", "secret") == 1
        assert client.rpop("tlsq") == b"secret"
        client.close()
        plain = Raw(d.redis_address)
        plain.send(b"PING\r\n")
        assert plain.closed(wait=5)  # no TLS handshake: nothing is served


def test_redis_clients_log_in_with_auth_or_hello(tmp_path: Path) -> None:
    users = tmp_path / "users"
    users.write_text("alice:s3cret pass\n")
    config = f'[server.auth]\nusers_file = "{users}"\n'
    with Daemon(tmp_path, config_text=config, redis=True) as d:
        raw = Raw(d.redis_address)
        noauth = b"-NOAUTH Authentication required.\r\n"
        raw.call(b"PING\r\nLPUSH q x\r\n", noauth + noauth)
        raw.call(
            b"AUTH alice wrong\r\n",
            b"-WRONGPASS invalid username-password pair or user is disabled.\r\n",
        )
        raw.call(b"PING\r\n", noauth)
        raw.call(b'AUTH alice "s3cret pass"\r\nPING\r\n', b"+OK\r\n+PONG\r\n")
        raw.close()
        host, port = d.redis_address
        # redis-py 8 logs in with HELLO 3 AUTH <user> <password>.
        client = redis.Redis(host=host, port=port, username="alice", password="s3cret pass")
        assert client.lpush("authq", "x") == 1
        assert client.rpop("authq") == b"x"
        client.close()
        wrong = redis.Redis(host=host, port=port, username="alice", password="nope")
        with pytest.raises(redis.AuthenticationError):
            wrong.ping()
    assert "authentication failed for user b'alice'" in d.log()
