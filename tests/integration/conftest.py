"""Fixtures shared by the integration tests."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, Path]:
    """CURVE key folders: the reserved side's (listing one node), that listed spot node's, and an
    unlisted node's; both nodes know the reserved side's public key."""
    from spotlight.comm.auth import generate_keypair

    reserved, good, bad = tmp_path / "reserved", tmp_path / "spot", tmp_path / "intruder"
    pub, _ = generate_keypair(reserved, "controller")
    node_pub, _ = generate_keypair(good, "node")
    (reserved / "nodes").mkdir()
    shutil.copy(node_pub, reserved / "nodes" / "spot-1.key")  # the operator lists the node
    generate_keypair(bad, "node")  # never listed
    for folder in (good, bad):
        shutil.copy(pub, folder / "controller.key")
    return {"reserved": reserved, "good": good, "bad": bad}
