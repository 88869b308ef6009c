"""A worker's weights in one flat buffer per version (``spotlight.parallel.flat``) and the versions
it holds (``WeightsVersions``): the model's parameters are views of the shared-memory segment, a
state dict loads through them, a held version switches by rebinding, a lent (pinned) version is
not reloaded until returned or its ttl passes, and a borrower copies a whole version from a cached
mapping of the lender's segment, refusing a copy the lender reloaded under it."""

from __future__ import annotations

import asyncio
import mmap
import os
import time

import numpy as np
import pytest
import torch

from spotlight.actors.worker.peers import PeerMappings, copy_lent, lent_message
from spotlight.actors.worker.versions import WeightsVersions
from spotlight.comm.shm import HEADER, attach
from spotlight.errors import ProtocolError
from spotlight.parallel.device import probe_cuda
from spotlight.parallel.flat import FlatWeights, bind, is_bound
from spotlight.recipe import load_recipe
from spotlight.work import policy_model

NO_CUDA = probe_cuda()
TINY = ["model.checkpoint=none", "model.layers=1", "model.heads=2", "model.head_dim=16",
        "model.image_size=16", "model.patch=4"]


def tiny_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return policy_model(load_recipe("tiny", TINY))


def test_parameters_are_views_of_the_segment_and_a_state_dict_loads_into_it():
    model, other = tiny_model(0), tiny_model(1)
    want = {k: v.clone() for k, v in other.state_dict().items()}
    buf = FlatWeights.like(model)
    try:
        buf.load_state(model.state_dict())
        before = {k: v.clone() for k, v in model.state_dict().items()}
        bind(model, buf)
        assert is_bound(model, buf)
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # same values
        model.load_state_dict(want)  # writes through the views into the segment
        mm = attach(buf.segment)  # a second mapping, as a neighbour would have
        try:
            for name, (dtype, shape, off) in buf.layout.items():
                got = np.frombuffer(mm, dtype=dtype, count=int(np.prod(shape)), offset=HEADER + off)
                assert np.array_equal(got.reshape(shape), want[name].numpy()), name
            del got
        finally:
            mm.close()
        assert all(isinstance(p, torch.nn.Parameter) for p in model.parameters())
        with pytest.raises(ValueError, match="layout"):
            bind(torch.nn.Linear(2, 2), buf)
    finally:
        buf.close()


async def test_held_versions_switch_by_rebinding_and_the_oldest_is_reloaded():
    model = tiny_model()
    vs = WeightsVersions(model, keep=2, ttl_s=60)
    try:
        assert len(vs.buffers) == 3 and is_bound(model, vs.buffers[0])
        for v in (0, 1, 2):
            buf = await vs.slot_for(v)
            buf.flat.fill_(v + 1)
            buf.version = v
            vs.use(buf)
            assert is_bound(model, buf) and all(bool((p == p.flatten()[0]).all()) for p in model.parameters())
        assert vs.versions() == {0, 1, 2}
        vs.use(vs.held(0))  # a held version: no copy, the model's memory is that buffer
        assert is_bound(model, vs.held(0))
        buf = await vs.slot_for(3)  # the oldest version's buffer (v0: the current one) is reused
        assert vs.versions() == {1, 2} and vs.current is None and buf.version is None
    finally:
        vs.close()


async def test_a_pinned_version_is_not_reloaded_until_returned():
    vs = WeightsVersions(tiny_model(), keep=1, ttl_s=60)
    try:
        buf = await vs.slot_for(0)
        buf.version = 0
        vs.use(buf)
        token = vs.pin(buf)
        gen = buf.generation
        switch = asyncio.ensure_future(vs.slot_for(1))
        for _ in range(20):
            await asyncio.sleep(0)
        assert not switch.done() and buf.version == 0 and buf.generation == gen  # held for the borrower
        vs.unpin(token)
        assert await asyncio.wait_for(switch, 5) is buf
        assert buf.version is None and buf.generation == gen + 1
    finally:
        vs.close()


async def test_a_pin_never_returned_ends_after_its_ttl():
    ttl = 0.3
    vs = WeightsVersions(tiny_model(), keep=1, ttl_s=ttl)
    try:
        buf = await vs.slot_for(0)
        buf.version = 0
        t0 = time.monotonic()
        vs.pin(buf)  # a borrower that died without returning it
        assert vs.lent == 1
        assert await asyncio.wait_for(vs.slot_for(1), 10 * ttl) is buf
        assert time.monotonic() - t0 >= ttl * 0.99 and vs.lent == 0
    finally:
        vs.close()


async def test_a_borrower_copies_the_whole_version_from_a_cached_mapping():
    lender_model, borrower_model = tiny_model(0), tiny_model(1)
    lender = FlatWeights.like(lender_model)
    mine = FlatWeights.like(borrower_model)
    maps = PeerMappings()
    try:
        for v in (5, 6):  # two versions lent from the same buffer: one mapping serves both
            lender.reload()
            lender_model.load_state_dict(tiny_model(v).state_dict())
            lender.load_state(lender_model.state_dict())
            lender.version = v
            lent = lent_message(v, "tok", lender)
            assert copy_lent(lent, os.getpid(), mine, maps) == lender.nbytes
            assert torch.equal(mine.flat, lender.flat)
            assert len(maps) == 1
        bind(borrower_model, mine)
        assert all(torch.equal(a, b) for a, b in zip(borrower_model.state_dict().values(),
                                                        lender_model.state_dict().values(), strict=True))
        (mapping,) = maps._maps.values()
        assert isinstance(mapping, mmap.mmap)

        lender.reload()  # the lender reloaded the buffer after lending it: the copy is refused
        with pytest.raises(ProtocolError, match="reloaded"):
            copy_lent(lent, os.getpid(), mine, maps)
        bad = lent_message(6, "tok", lender)
        bad.layout = dict(list(bad.layout.items())[1:])
        with pytest.raises(ProtocolError, match="layout"):
            copy_lent(bad, os.getpid(), mine, maps)
    finally:
        maps.close()
        lender.close()
        mine.close()


@pytest.mark.gpu
@pytest.mark.skipif(NO_CUDA is not None, reason=f"no CUDA: {NO_CUDA}")
async def test_on_a_gpu_the_parameters_are_views_of_one_cuda_tensor():
    model = tiny_model(0).to("cuda")
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    vs = WeightsVersions(model, keep=1, ttl_s=60)
    try:
        (buf,) = vs.buffers
        assert buf.flat.is_cuda and is_bound(model, buf)
        assert all(torch.equal(v, ref[k]) for k, v in model.state_dict().items())
        lent = lent_message(0, "tok", buf)
        assert lent.cuda is not None and lent.segment == "" and lent.nbytes == buf.nbytes
    finally:
        vs.close()


async def test_a_dead_lenders_mapping_is_dropped_when_it_exits_not_at_the_next_borrow():
    from spotlight.actors.worker.peers import _exited

    lender = FlatWeights.like(tiny_model(0))
    mine = FlatWeights.like(tiny_model(1))
    maps = PeerMappings()
    # A stand-in lender process: the mapping is keyed by its pid, the segment is ours.
    child = await asyncio.create_subprocess_exec("sleep", "60")
    try:
        lent = lent_message(0, "tok", lender)
        copy_lent(lent, child.pid, mine, maps)
        maps.watch(child.pid)
        maps.watch(child.pid)  # once per lender
        assert len(maps) == 1 and list(maps._watched) == [child.pid]
        child.kill()
        await _exited(child.pid)
        for _ in range(10):  # its pidfd and ours became readable together: a loop turn or two
            if not len(maps):
                break
            await asyncio.sleep(0)
        assert len(maps) == 0 and maps._watched == {}
        await child.wait()
        maps.watch(child.pid)  # a lender already gone: nothing is watched
        assert maps._watched == {}
    finally:
        if child.returncode is None:
            child.kill()
            await child.wait()
        maps.close()
        lender.close()
        mine.close()


def test_kept_versions_that_do_not_fit_the_device_are_one_line_naming_the_field():
    from spotlight.actors.worker.versions import check_fits
    from spotlight.errors import ConfigError

    gib = 2**30
    check_fits(40 * gib, 1, 41 * gib, "cuda:0")  # one copy: whatever fits, fits (the model is there)
    check_fits(20 * gib, 3, 80 * gib, "cuda:0")  # 60 of 80 GiB
    with pytest.raises(ConfigError, match=r"^runtime.worker_versions keeps 3 copies of the weights "
                                          r"\(120.0 GiB\) on cuda:0, which has 80.0 GiB free: set "
                                          r"runtime.worker_versions = 1") as e:
        check_fits(40 * gib, 3, 80 * gib, "cuda:0")  # Qwen-Image 20B in bf16 on an 80 GB GPU
    assert "\n" not in str(e.value)
