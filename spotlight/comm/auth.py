"""CURVE keys for ZeroMQ over TCP: create key files, load them, and describe who may connect.

Key files are ZeroMQ's own format (``zmq.auth.create_certificates``): ``NAME.key`` holds the
public key (shareable), ``NAME.key_secret`` the public + secret key (mode 0600). A server is
given its secret file and a folder of the public key files of the clients it accepts; a client
is given its secret file and the server's public file.

A cluster uses one folder of keys per node (``cluster_server_keys`` / ``cluster_client_keys``):

    reserved node  DIR/controller.key_secret   the reserved side's identity: the controller, the
                                               request queue and the tensor store all serve with it
                   DIR/nodes/*.key             public keys of the nodes allowed to connect
    spot node      DIR/node.key_secret         this node's key pair (its .key goes in the
                                               reserved node's nodes/ folder)
                   DIR/controller.key          the reserved side's public key

The reserved side's own clients (the controller's queue/store clients, the reserved node agent
and its workers) use the reserved key pair, which every reserved service also accepts.

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
    print(f"public key: {public}\nsecret key: {secret}  (keep it on this node only)")
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


SERVER_SECRET, SERVER_PUBLIC, NODE_SECRET, CLIENTS_DIR = (
    "controller.key_secret", "controller.key", "node.key_secret", "nodes")


def cluster_server_keys(directory: str | os.PathLike) -> CurveServerKeys:
    """Server keys of every reserved service: DIR/controller.key_secret, accepting the keys in
    DIR/nodes/ and the reserved side's own pair."""
    folder = Path(directory)
    keys = server_keys(folder / SERVER_SECRET, folder / CLIENTS_DIR)
    return CurveServerKeys(public=keys.public, secret=keys.secret,
                           allowed_clients=keys.allowed_clients | {keys.public})


def cluster_client_keys(directory: str | os.PathLike) -> CurveClientKeys:
    """Client keys for a node's sockets to the reserved services: DIR/node.key_secret (a spot
    node) or DIR/controller.key_secret (the reserved node), and the reserved public key."""
    folder = Path(directory)
    if not folder.is_dir():
        raise NotFound(f"keys folder {folder} does not exist")
    secret = folder / NODE_SECRET
    if not secret.is_file():
        secret = folder / SERVER_SECRET
        if not secret.is_file():
            raise NotFound(f"keys folder {folder} holds neither {NODE_SECRET} (a spot node) nor "
                           f"{SERVER_SECRET} (the reserved node); make one with `spotlight keys`")
    server = folder / SERVER_PUBLIC
    return client_keys(secret, server if server.is_file() else folder / SERVER_SECRET)


def _load(path: str | os.PathLike) -> tuple[bytes, bytes | None]:
    if not Path(path).is_file():
        raise NotFound(f"key file {path} does not exist")
    try:
        return zmq.auth.load_certificate(str(path))
    except (ValueError, OSError) as e:
        raise ConfigError(f"{path} is not a ZeroMQ key file: {e}") from None
