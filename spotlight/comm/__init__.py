"""Inter-process communication for Spotlight; no pickle on any wire.

- ``messages``: every wire message as a typed class, registered by a short tag.
- ``codec``: message <-> frames (msgpack header + zero-copy out-of-band tensor frames), with
  validation that turns any malformed input into ``ProtocolError``.
- ``transport``: asyncio ZeroMQ request/reply (``RpcServer`` ROUTER, ``RpcClient`` DEALER),
  optional CURVE on tcp.
- ``auth``: CURVE key files (``keys_main`` backs ``spotlight keys``).
- ``shm``: same-machine bulk tensors in POSIX shared memory, sent as small descriptors.

Submodules are imported explicitly (``from spotlight.comm.codec import encode``) so that using
one does not pull in ZeroMQ or numpy where they are not needed.
"""
