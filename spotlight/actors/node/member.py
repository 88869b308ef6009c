"""A persistent SP group member: one process, one model, any number of groups over its life.

    python -m spotlight.actors.node.member --id NAME --agent ipc://... --spec spec.json

Two threads. The **control loop** (main thread) owns the socket to the node agent and answers
status, leave and stop at once, whatever the compute is doing. The **compute thread** runs the
groups it is told to form, one after another: open the epoch's communicator, parallelize the DiT
over it, resume the rollout from the commit it names, run step after step (rank 0 commits each
one), and report done — or released, with the reason, when a collective failed (a dead peer
closes its sockets: gloo raises within milliseconds) or the agent said leave. The model is built
and loaded once, at start: from the store's weights file, or copied from a peer's shared memory.
A member never restarts for a regroup.

The compute thread talks to the control loop through an inproc socket (ZeroMQ sockets are not
shared between threads). This module is the process shell; the scheduling decisions are in
`spotlight.actors.node.groups` (in the agent).

The member is `group_shell`'s (the benchmark's harness, commits to files). In a run, SP groups are
made of ordinary workers (`spotlight.actors.worker.sp`: the same per-epoch communicators, the same
processor, a compute thread), so a group's rollout is the lone worker's code and commit protocol.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import threading
import time
from pathlib import Path

import torch
import zmq

from spotlight.comm import messages as m
from spotlight.comm.codec import decode, encode


def commit_path(commit_dir: str | Path, request_id: str, step: int) -> Path:
    return Path(commit_dir) / f"{request_id}-{step}.safetensors"


def write_commit(path: Path, state) -> None:
    """A rollout state after `state.step` steps, atomically (a reader never sees half a file)."""
    from safetensors.torch import save_file

    tensors = {"latents": torch.stack(state.latents).cpu().contiguous()}
    if state.log_probs:
        tensors["log_probs"] = torch.stack(state.log_probs).cpu().contiguous()
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata={"step": str(state.step)})
    os.replace(tmp, path)


def read_commit(path: Path, device: torch.device | str = "cpu"):
    from safetensors import safe_open
    from safetensors.torch import load_file

    from spotlight.policy.sampler import RolloutState

    with safe_open(str(path), "pt") as f:
        step = int(f.metadata()["step"])
    t = load_file(str(path), device=str(device))
    latents = list(t["latents"].unbind(0))
    log_probs = list(t["log_probs"].unbind(0)) if "log_probs" in t else []
    return RolloutState(x=latents[-1], step=step, latents=latents, log_probs=log_probs)


def build(spec: dict):
    """The member's model, with its weights from the store file or a peer's segment; returns
    (model, where from, bytes moved, seconds moving them)."""
    from safetensors.torch import load_file

    from spotlight.data.scenes import VOCABULARY
    from spotlight.models.dit import ModelConfig, build_model

    device = torch.device(spec.get("device", "cpu"))
    model = build_model(ModelConfig(**spec["model"]), VOCABULARY).requires_grad_(False).eval().to(device)
    t0 = time.perf_counter()
    if spec.get("peer"):
        from spotlight.parallel.peer import copy_from_cuda_peer, copy_from_segment

        peer = spec["peer"]
        if peer["segment"]:
            nbytes = copy_from_segment(model, peer["segment"], peer["layout"])
        else:  # the lender's GPU memory through CUDA IPC, copied GPU to GPU
            nbytes = copy_from_cuda_peer(model, peer["layout"])
        return model, "peer", nbytes, time.perf_counter() - t0
    state = load_file(spec["weights"], device=str(device))
    model.load_state_dict(state)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    return model, "store", nbytes, time.perf_counter() - t0


class Member:
    def __init__(self, name: str, agent: str, spec: dict) -> None:
        from spotlight.parallel.comms import Communicators
        from spotlight.policy.sampler import SamplerConfig

        t0 = time.perf_counter()
        self.name, self.spec = name, spec
        self.model, weights_from, weights_bytes, weights_s = build(spec)
        load_s = time.perf_counter() - t0
        self.sampler = SamplerConfig(**spec["sampler"])
        cfg = self.model.cfg
        self.shape = cfg.shape
        self.device = next(self.model.parameters()).device
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        self.comms = Communicators("127.0.0.1", spec["store_port"], timeout_s=spec["timeout_s"],
                                   backend=backend)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.connect(agent)
        self.events = self.ctx.socket(zmq.PAIR)
        self.events.bind(f"inproc://events-{id(self)}")
        self.forms: queue.Queue[m.GroupForm | None] = queue.Queue()
        self.left: set[int] = set()  # epochs the agent broke: stop at the next step boundary
        self.epoch: int | None = None
        self.step: int | None = None
        self.in_step = False
        self.shared = None  # the segment of weights lent to a joining peer (kept until exit)
        self._send(m.MemberHello(member=name, pid=os.getpid(), load_s=load_s, weights_from=weights_from,
                                 weights_bytes=weights_bytes, weights_s=weights_s))

    def _send(self, msg: m.Message) -> None:
        self.sock.send_multipart(encode(msg), copy=False)

    # --- control loop -------------------------------------------------------------------------------
    def serve(self) -> None:
        compute = threading.Thread(target=self._compute, name="compute", daemon=True)
        compute.start()
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.events, zmq.POLLIN)
        while True:
            ready = dict(poller.poll(1000))
            if self.events in ready:
                self.sock.send_multipart(self.events.recv_multipart(copy=False), copy=False)
            if self.sock not in ready:
                continue
            msg = decode(self.sock.recv_multipart(copy=False))
            if isinstance(msg, m.MemberStatus):
                self._send(m.MemberProgress(member=self.name, nonce=msg.nonce, epoch=self.epoch,
                                            step=self.step, in_collective=self.in_step))
            elif isinstance(msg, m.GroupForm):
                self.forms.put(msg)
            elif isinstance(msg, m.GroupLeave):
                self.left.add(msg.epoch)
            elif isinstance(msg, m.ShareWeights):
                from spotlight.parallel.peer import share, share_cuda

                if self.device.type == "cuda":  # IPC handles of the live parameters: nothing to free
                    layout, nbytes = share_cuda(self.model)
                    segment = ""
                else:
                    if self.shared is not None:
                        self.shared.close()  # one lent copy at a time
                    self.shared, layout, nbytes = share(self.model)
                    segment = self.shared.name
                self._send(m.WeightsShared(member=self.name, nonce=msg.nonce, segment=segment,
                                           nbytes=nbytes, layout=layout))
            elif isinstance(msg, m.MemberStop):
                return

    # --- compute thread -------------------------------------------------------------------------------
    def _compute(self) -> None:
        torch.set_num_threads(1)
        if self.device.type == "cuda":  # the current device is per thread; NCCL uses it
            torch.cuda.set_device(self.device)
        events = self._events_out = self.ctx.socket(zmq.PAIR)
        events.connect(f"inproc://events-{id(self)}")
        try:
            while (form := self.forms.get()) is not None:
                events.send_multipart(encode(self._run(form)))
        finally:
            events.close(linger=0)

    def _run(self, form: m.GroupForm) -> m.Message:
        from spotlight.parallel.ulysses import parallelize
        from spotlight.policy.sampler import start
        from spotlight.work import Rollout

        self.epoch, self.step, sp = form.epoch, form.resume_step, None
        try:
            group = self.comms.open(form.epoch, form.rank, form.size)
            sp = parallelize(self.model.dit, group) if form.size > 1 else None
            cdir = self.spec["commit_dir"]
            state = None
            if form.resume_step:
                state = read_commit(commit_path(cdir, form.request_id, form.resume_step), self.device)
            else:  # the start: x_1 drawn on the CPU (same bits everywhere), then moved
                state = start(form.job.seeds, self.shape, self.device, form.job.init_seed)
            rollout = Rollout(self.model, form.job, self.sampler, self.shape, state)
            while not rollout.done:
                if form.epoch in self.left:
                    return m.GroupReleased(member=self.name, epoch=form.epoch, error="left at a step end")
                self.in_step = True
                state = rollout.step()
                self.in_step = False
                self.step = state.step
                if form.rank == 0:
                    write_commit(commit_path(cdir, form.request_id, state.step), state)
                    self._event(m.GroupCommitted(member=self.name, epoch=form.epoch, step=state.step))
            return m.GroupDone(member=self.name, epoch=form.epoch)
        except Exception as e:  # a collective failed (dead peer, timeout): the agent regroups us
            error = f"{type(e).__name__}: {e}"[:500]
            return m.GroupReleased(member=self.name, epoch=form.epoch, error=error)
        finally:
            self.in_step = False
            if sp is not None:
                sp.undo()
            self.comms.close()
            self.epoch = None

    def _event(self, msg: m.Message) -> None:
        self._events_out.send_multipart(encode(msg))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--id", required=True)
    ap.add_argument("--agent", required=True)
    ap.add_argument("--spec", required=True)
    args = ap.parse_args(argv)
    from spotlight.actors.procs import die_with_parent

    die_with_parent()  # the agent is the persistent one: a member never outlives it
    torch.set_num_threads(1)
    member = Member(args.id, args.agent, json.loads(Path(args.spec).read_text()))
    try:
        member.serve()
    finally:
        if member.shared is not None:
            member.shared.close()  # unlink the lent weights
        member.sock.close(linger=0)
    # The compute thread may be blocked in a collective on a hung peer and cannot be joined; the
    # process is ending anyway, so leave without waiting for it (sockets of the thread die with us).
    os._exit(0)

if __name__ == "__main__":
    main()
