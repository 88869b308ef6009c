"""Ulysses SP over real gloo process groups: degrees 2 and 4 give the single-process DiT's
velocity, the trainer's per-step log-prob, a whole SDE rollout and the parameter gradients.
Bad degrees fail with one line naming `runtime.sp_degree`."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

from spotlight.data.scenes import VOCABULARY
from spotlight.errors import ConfigError
from spotlight.models.dit import ModelConfig, build_model
from spotlight.parallel.comms import host_store
from spotlight.parallel.exactness import check
from spotlight.parallel.ulysses import check_degree, parallelize

TOL = 1e-5  # fp32; the forward comes out bit-identical here, gradients differ by summation order


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("degree", [2, 4])
def test_sp_matches_single_process(degree):
    r = check(degree, timeout_s=280)
    assert r["tokens_per_rank"] == r["tokens"] // degree  # the DiT really ran on a shard
    for key in ("velocity", "log_prob", "rollout", "rollout_log_probs"):
        assert r[key] <= TOL * max(1.0, r["scale"][key]), (key, r[key])
    assert r["grads"] <= 1e-4 * r["scale"]["grads"], r["grads"]
    assert r["scale"]["velocity"] > 0.1  # a real, non-zero output was compared


@pytest.mark.parametrize(
    "degree, heads, tokens, words",
    [(3, 4, 64, "model.heads = 4"), (2, 4, 63, "image tokens (63"), (0, 4, 64, ">= 1")],
)
def test_bad_degree_is_one_clear_line(degree, heads, tokens, words):
    with pytest.raises(ConfigError) as e:
        check_degree(degree, heads, tokens)
    msg = str(e.value)
    assert "runtime.sp_degree" in msg and words in msg and "\n" not in msg


class _FakeGroup:  # parallelize reads only size and rank before its checks
    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return 0


def test_parallelize_checks_heads_and_tokens_and_degree_one_is_the_plain_model():
    cfg = ModelConfig(checkpoint=None, layers=1, heads=2, head_dim=16, image_size=12, patch=4)
    model = build_model(cfg, VOCABULARY)
    with pytest.raises(ConfigError, match=r"runtime.sp_degree \(4\) must divide the attention heads"):
        parallelize(model.dit, _FakeGroup(4))
    x, t = torch.randn(2, 3, 12, 12), torch.tensor([0.5, 0.2])
    with torch.no_grad():
        text = model.encode(["a red circle", "a blue square"])
        sp = parallelize(model.dit, _FakeGroup(2))  # 9 image tokens: refused at the first call
        with pytest.raises(ConfigError, match=r"must divide the image tokens \(9"):
            model.velocity(x, t, text)
        sp.undo()
        ref = model.velocity(x, t, text)
        store = host_store()  # degree 1 over a real one-member gloo group: the plain model, bit for bit
        group = dist.ProcessGroupGloo(dist.PrefixStore("t/", store), 0, 1, datetime.timedelta(seconds=5))
        sp = parallelize(model.dit, group)
        par = model.velocity(x, t, text)
        sp.undo()
        again = model.velocity(x, t, text)
    assert torch.equal(par, ref) and torch.equal(again, ref)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sp_matches_single_process_on_a_qwen_image_pipeline(tiny_pipeline_dir):
    """The same processor on a diffusers Qwen-Image folder's transformer: packed latent tokens,
    its RoPE, the text mask and true CFG with the negative prompt, at degree 2."""
    r = check(2, timeout_s=280, pipeline=tiny_pipeline_dir("qwen-image"))
    assert r["tokens_per_rank"] == r["tokens"] // 2
    for key in ("velocity", "log_prob", "rollout", "rollout_log_probs"):
        assert r[key] <= TOL * max(1.0, r["scale"][key]), (key, r[key])
    assert r["grads"] <= 1e-4 * r["scale"]["grads"], r["grads"]
    assert r["scale"]["velocity"] > 0.1
