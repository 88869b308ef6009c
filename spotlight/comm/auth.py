"""CURVE keys for ZeroMQ over TCP: create key files, load them, and describe who may connect.

Key files are ZeroMQ's own format (``zmq.auth.create_certificates``): ``NAME.key`` holds the
public key (shareable), ``NAME.key_secret`` the public + secret key (mode 0600). A server is
given its secret file and a folder of the public key files of the clients it accepts; a client
is given its secret file and the server's public file.

This module knows key files and key sets; the transport (``spotlight.comm.transport``) applies
them to sockets. It knows nothing of messages.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth

from spotlight.errors import ConfigError, NotFound


@dataclass(frozen=True, slots=True)
class CurveServerKeys:
    """What a CURVE server needs."""

    public: bytes
    """the server's public key (z85); clients must know it."""
    secret: bytes
    """the server's secret key (z85)."""
    allowed_clients: frozenset[bytes]
    """public keys (z85) of the clients that may connect; every other client is refused."""


@dataclass(frozen=True, slots=True)
class CurveClientKeys:
    """What a CURVE client needs."""

    public: bytes
    """the client's public key (z85); must be in the server's allowed set."""
    secret: bytes
    """the client's secret key (z85)."""
    server_public: bytes
    """the server's public key (z85)."""


def generate_keypair(directory: str | os.PathLike, name: str) -> tuple[Path, Path]:
    """Write ``NAME.key`` and ``NAME.key_secret`` in ``directory``; return (public, secret) paths.
    Refuses to overwrite existing keys (a silently rotated key locks every peer out)."""
    if not zmq.has("curve"):
        raise ConfigError("this libzmq was built without CURVE support")
    if not name or "/" in name or name.startswith("."):
        raise ConfigError(f"key name must be a plain file name, got {name!r}")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    public, secret = out / f"{name}.key", out / f"{name}.key_secret"
    for path in (public, secret):
        if path.exists():
            raise ConfigError(f"key file {path} already exists; remove it to make a new pair")
    pub_file, sec_file = zmq.auth.create_certificates(str(out), name)
    os.chmod(sec_file, 0o600)
    return Path(pub_file), Path(sec_file)


def keys_main(out_dir: str, name: str) -> tuple[Path, Path]:
    """Entry for ``spotlight keys``: make a key pair, print where it went, return the paths."""
    public, secret = generate_keypair(out_dir, name)
    print(f"public key: {public}\nsecret key: {secret} (keep private)")
    return public, secret


def load_public_key(path: str | os.PathLike) -> bytes:
    """The z85 public key from a ``.key`` or ``.key_secret`` file."""
    return _load(path)[0]


def load_keypair(path: str | os.PathLike) -> tuple[bytes, bytes]:
    """(public, secret) z85 keys from a ``.key_secret`` file."""
    public, secret = _load(path)
    if secret is None:
        raise ConfigError(f"{path} holds no secret key (give the .key_secret file)")
    return public, secret


def load_public_keys(directory: str | os.PathLike) -> frozenset[bytes]:
    """Every public key in the ``*.key`` files of ``directory``."""
    folder = Path(directory)
    if not folder.is_dir():
        raise NotFound(f"public-key folder {folder} does not exist")
    return frozenset(load_public_key(p) for p in sorted(folder.glob("*.key")))


def server_keys(secret_file: str | os.PathLike, clients_dir: str | os.PathLike) -> CurveServerKeys:
    public, secret = load_keypair(secret_file)
    return CurveServerKeys(public=public, secret=secret,
                           allowed_clients=load_public_keys(clients_dir))


def client_keys(secret_file: str | os.PathLike,
                server_public_file: str | os.PathLike) -> CurveClientKeys:
    public, secret = load_keypair(secret_file)
    return CurveClientKeys(public=public, secret=secret,
                           server_public=load_public_key(server_public_file))


def _load(path: str | os.PathLike) -> tuple[bytes, bytes | None]:
    if not Path(path).is_file():
        raise NotFound(f"key file {path} does not exist")
    try:
        return zmq.auth.load_certificate(str(path))
    except (ValueError, OSError) as e:
        raise ConfigError(f"{path} is not a ZeroMQ key file: {e}") from None
