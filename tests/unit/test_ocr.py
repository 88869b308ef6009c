"""The text-rendering task (issue 27): the OCR reward read by the real PP-OCRv4 model, the word
grammar, non-square canvases through the model and sampler, and recipe `ocr` on the shipped base.

The reward cases mirror `bench/reward_validation.py --reward ocr` on a few fixed words: rendered
words must read back (>= 0.95), blank, noise, another word, scrambled letters and mirror images
must score low. Seeded and CPU-only.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

pytest.importorskip("rapidocr_onnxruntime")

from spotlight import Experiment, load_recipe  # noqa: E402
from spotlight.data import text as text_task  # noqa: E402
from spotlight.data.prompts import heldout_prompts, prompt_set  # noqa: E402
from spotlight.errors import ConfigError  # noqa: E402
from spotlight.models.dit import ModelConfig, build_model, patchify, unpatchify  # noqa: E402
from spotlight.models.text import WordTokenizer  # noqa: E402
from spotlight.policy.sampler import SamplerConfig, sample_ode, sample_policy  # noqa: E402
from spotlight.rewards import make_reward  # noqa: E402
from spotlight.rewards.ocr import OcrReward, edit_distance, text_score  # noqa: E402

WORDS = ["CAT", "SPOT", "ZEBRA", "GARDEN", "BUG", "MAGNET", "FLAME", "QUIZ"]
OTHER = ["DOG", "TOWN", "HORSE", "BORDER", "HAM", "ROCKET", "SPARK", "JAZZ"]  # same lengths


@pytest.fixture(scope="module")
def reward() -> OcrReward:
    r = make_reward("ocr", mode="line", threads=2)
    yield r
    r.close()


def _batch(words: list[str]) -> np.ndarray:
    return np.stack([text_task.render_word(w, 16, 64) for w in words])


def _prompts(words: list[str]) -> list[str]:
    return [text_task.prompt_for(w, i) for i, w in enumerate(words)]


def test_rendered_words_read_back(reward):
    scores = reward(_batch(WORDS), _prompts(WORDS))
    assert scores.dtype == np.float32 and scores.shape == (8,)
    assert scores.mean() >= 0.95, scores


def test_negatives_score_low(reward):
    prompts = _prompts(WORDS)
    img = _batch(WORDS)
    blank = np.full_like(img, 255)
    noise = np.random.default_rng(0).integers(0, 256, img.shape, dtype=np.uint8)
    mirrored = np.ascontiguousarray(img[:, :, ::-1])
    scrambled = _batch([w[::-1] if w[::-1] != w else w[1:] + w[0] for w in WORDS])
    assert reward(blank, prompts).max() == 0.0
    assert reward(noise, prompts).mean() < 0.15
    assert reward(_batch(OTHER), prompts).mean() < 0.3
    assert reward(mirrored, prompts).mean() < 0.35
    assert reward(scrambled, prompts).mean() < 0.5


def test_score_definition():
    # Flow-GRPO's: case and whitespace never count; full-width forms (the recogniser's) normalised
    assert text_score("spot", "SPOT") == 1.0
    assert text_score("S P O T", "SPOT") == 1.0
    assert text_score("ＳＰＯＴ", "SPOT") == 1.0
    assert text_score("SPIT", "SPOT") == pytest.approx(0.75)
    assert text_score("", "SPOT") == 0.0
    assert text_score("ABCDEFGHIJ", "SPOT") == 0.0  # clipped at n edits
    assert edit_distance("kitten", "sitting") == 3


def test_async_matches_sync_and_weighted(reward):
    img, prompts = _batch(WORDS[:4]), _prompts(WORDS[:4])
    sync = reward(img, prompts)
    assert np.array_equal(asyncio.run(reward.score_async(img, prompts)), sync)

    async def scored_while_ticking() -> tuple[np.ndarray, int]:
        ticks = 0
        task = asyncio.ensure_future(reward.score_async(_batch(WORDS * 2), _prompts(WORDS * 2)))
        while not task.done():
            ticks += 1
            await asyncio.sleep(0.001)
        return await task, ticks

    scores, ticks = asyncio.run(scored_while_ticking())
    assert scores.mean() >= 0.95 and ticks > 1  # the loop ran while the pool read
    combo = make_reward("weighted", terms=[{"name": "ocr", "weight": 1.0}, {"name": "jpeg", "weight": 0.0}])
    assert np.allclose(combo(img, prompts), sync)


def test_column_credit_says_which_letters_are_right(reward):
    """The map marks each read letter where it stands: 1 on the right ones, 0 on a wrong or an
    extra one, the image's score elsewhere; async, weighted and full mode agree with it."""
    words = ["BOG", "SPOTS", "GARDEN"]  # read for BUG (O wrong), SPOT (an extra S), GARDEN
    img, prompts = _batch(words), _prompts(["BUG", "SPOT", "GARDEN"])
    scores, maps = reward.columns(img, prompts)
    assert np.array_equal(scores, reward(img, prompts)) and maps.shape == (3, 64)
    cell = 64 / text_task.MAX_LETTERS
    def at(word, i):  # the column at the centre of letter i of a rendered word
        return int((64 - cell * len(word)) / 2 + cell * (i + 0.5))
    assert [maps[0, at("BOG", i)] for i in range(3)] == [1.0, 0.0, 1.0]
    assert [maps[1, at("SPOTS", i)] for i in range(5)] == [1.0, 1.0, 1.0, 1.0, 0.0]
    assert maps[1, 0] == pytest.approx(0.75) and maps[1, 63] == pytest.approx(0.75)  # away from letters
    assert (maps[2] == 1.0).all()
    a_scores, a_maps = asyncio.run(reward.columns_async(img, prompts))
    assert np.array_equal(a_scores, scores) and np.array_equal(a_maps, maps)
    combo = make_reward("weighted", terms=[{"name": "ocr", "weight": 2.0}, {"name": "jpeg", "weight": 0.0}])
    assert np.allclose(combo.columns(img, prompts)[1], 2 * maps)
    assert (reward.columns(np.full_like(img, 255), prompts)[1] == 0).all()  # nothing read: the score


def test_column_advantages_weight_letters_not_words():
    from spotlight.policy.grpo import GRPOConfig, advantages, column_advantages

    rewards = torch.tensor([1.0, 0.5, 0.5, 0.0])
    flat = rewards[:, None].expand(-1, 8)
    assert torch.allclose(column_advantages(flat, 4), advantages(rewards)[:, None].expand(-1, 4), atol=1e-5)
    credit = torch.tensor([[1.0] * 4 + [1.0] * 4,  # both letters right
                           [1.0] * 4 + [0.0] * 4,  # the second wrong
                           [0.0] * 4 + [1.0] * 4,  # the first wrong
                           [1.0] * 4 + [1.0] * 4])
    adv = column_advantages(credit, 8)
    assert (adv[1, 4:] < 0).all() and (adv[1, :4] > 0).all()  # pushed off its wrong letter only
    assert (adv[2, :4] < 0).all() and (adv[2, 4:] > 0).all()
    assert torch.allclose(adv.sum(0), torch.zeros(8), atol=1e-6)
    assert (column_advantages(torch.ones(4, 8), 8) == 0).all()
    with pytest.raises(ConfigError, match="awm_credit"):
        GRPOConfig(awm_credit="pixels")
    with pytest.raises(ConfigError, match="needs objective 'awm'"):
        GRPOConfig(objective="grpo", awm_credit="columns")


def test_full_image_mode_detects_then_reads(reward):
    from PIL import Image

    canvas = np.full((128, 160, 3), 230, np.uint8)
    strip = np.asarray(Image.fromarray(text_task.render_word("GARDEN", 16, 64)).resize((128, 32)))
    canvas[48:80, 16:144] = strip
    full = OcrReward(mode="auto")  # 160x128 is not a strip: detection + recognition
    try:
        assert full(canvas[None], ['a sign that says "GARDEN"'])[0] == 1.0
    finally:
        full.close()


def test_bad_input_is_one_line(reward):
    with pytest.raises(ConfigError, match="no quoted text") as e:
        reward(_batch(["CAT"]), ["a sign that says CAT"])
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="word list is empty"):
        text_task.word_prompts([])
    with pytest.raises(ConfigError, match="3-6 capital letters"):
        text_task.word_prompts(["toolongword"])
    with pytest.raises(ConfigError, match="does not load"):
        text_task.load_font("/nonexistent/font.ttf", 14)
    with pytest.raises(ConfigError, match="ocr.mode"):
        make_reward("ocr", mode="page")


def test_word_lists_and_tokenizer():
    train, held = set(text_task.TRAIN_WORDS), set(text_task.HELDOUT_WORDS)
    assert train.isdisjoint(held) and len(train) >= 300 and len(held) >= 16
    def placed(w: str) -> set[tuple[str, int]]:  # (letter, offset from the centre in half letters)
        return {(c, 2 * i - (len(w) - 1)) for i, c in enumerate(w)}

    trained = set().union(*map(placed, train))
    assert all(placed(w) <= trained for w in held)  # every held-out letter is trained on, in place
    assert all(3 <= len(w) <= 6 for w in train | held)
    assert {text_task.quoted_text(p) for p in prompt_set("words")} == train
    assert {text_task.quoted_text(p) for p in heldout_prompts("words")} == held
    tok = WordTokenizer(text_task.VOCABULARY)
    ids, mask = tok(['a sign that says "SPOT"', 'the word "BUG"'])
    assert (ids[mask.bool()] != WordTokenizer.UNK).all()  # an unseen word is spelled, not unknown
    assert int(mask[0].sum()) == 4 + 4 and int(mask[1].sum()) == 2 + 3
    spelled = [tok.vocabulary[i - 2] for i in ids[0, 4:8].tolist()]
    assert spelled == ['"s@-3', '"p@-1', '"o@1', '"t@3']
    assert tok.words('a sign that says "SPOT"') == ["a", "sign", "that", "says", *spelled]


def test_non_square_canvas_through_model_and_sampler():
    torch.manual_seed(0)
    cfg = ModelConfig(checkpoint=None, image_size=16, image_width=64, layers=1, heads=2, head_dim=16)
    assert cfg.shape == (3, 16, 64) and cfg.tokens == 64
    x = torch.randn(2, 3, 16, 64)
    assert torch.equal(unpatchify(patchify(x, 4), 4, 3, 16, 64), x)
    model = build_model(cfg, text_task.VOCABULARY).eval()
    prompts = ['the word "CAT"', 'the word "SPOT"']
    s = SamplerConfig(steps=2, eval_steps=2)
    with torch.no_grad():
        assert sample_ode(model, prompts, [1, 2], s, cfg.shape).shape == (2, 3, 16, 64)
        assert sample_policy(model, prompts, [1, 2], s, cfg.shape).shape == (2, 3, 16, 64)
    with pytest.raises(ConfigError, match="image_width"):
        ModelConfig(checkpoint=None, image_size=16, image_width=62)
    with pytest.raises(ConfigError, match="square"):
        ModelConfig(checkpoint=None, dit_class="SD3Transformer2DModel", image_size=16, image_width=64)


def test_recipe_ocr_runs_on_the_shipped_base(tmp_path):
    torch.set_num_threads(1)
    recipe = load_recipe("ocr", [
        f'run.out_dir="{tmp_path}"', "run.iterations=1", "run.prompts_per_iteration=2", "run.group_size=2",
        "run.eval_every=100", "run.eval_seeds=1", "run.eval_samples=1", "sampler.steps=2",
        "sampler.eval_steps=2", "reward.threads=1",
    ])
    assert recipe.reward.name == "ocr" and recipe.model.shape == (3, 16, 64)
    exp = Experiment(recipe)
    exp.run(progress=False)
    its = [r for r in exp.records if r["event"] == "iteration"]
    evals = [r for r in exp.records if r["event"] == "eval"]
    assert len(its) == 1 and len(its[0]["rewards"]) == 2
    assert all(0.0 <= x <= 1.0 for g in its[0]["rewards"] for x in g)
    assert evals and 0.0 <= evals[0]["eval_reward"] <= 1.0


def test_eval_defaults_to_the_recipes_checkpoint(tmp_path, capsys):
    """`spotlight eval --recipe ocr` evaluates the OCR base the recipe names, not the shapes base;
    `--checkpoint` still chooses another."""
    import json

    from spotlight.cli import main

    small = [f"--out={tmp_path}", "run.eval_seeds=1", "run.eval_samples=1", "sampler.eval_steps=2",
             "reward.threads=1"]
    for extra, want in (([], "builtin:ocr_base"), (["--checkpoint", "builtin:base"], "builtin:base")):
        capsys.readouterr()
        assert main(["eval", "--recipe", "ocr", *extra, *small]) == 0
        assert json.loads(capsys.readouterr().out)["checkpoint"] == want


def test_rendered_pretraining_set():
    import random

    from spotlight.pretrain import PretrainConfig, text_batch

    x, prompts = text_batch(random.Random(0), 4, 16, 64)
    assert x.shape == (4, 3, 16, 64) and x.min() == -1.0 and x.max() == 1.0
    assert all(text_task.quoted_text(p) in text_task.TRAIN_WORDS for p in prompts)
    with pytest.raises(ConfigError, match="pretrain.task"):
        PretrainConfig(task="letters")


def test_misspelling_pretraining_set():
    """`--misspell p` draws each letter of a rendered word as its look-alike with probability p
    while the caption keeps the word; 0 draws nothing extra from the stream (the default data are
    unchanged); bad values are one ConfigError line."""
    import random

    from spotlight.pretrain import PretrainConfig, misspelled, text_batch

    rng = random.Random(0)
    words = [rng.choice(text_task.TRAIN_WORDS) for _ in range(2000)]
    drawn = [misspelled(rng, w, 0.4) for w in words]
    letters = sum(len(w) for w in words)
    wrong = sum(a != b for w, d in zip(words, drawn) for a, b in zip(w, d))
    alike = text_task.LOOKALIKE
    assert all(b in (a, alike[a]) for w, d in zip(words, drawn) for a, b in zip(w, d, strict=True))
    assert sorted(alike) == list(text_task.LETTERS)  # a pairing of the 26 capitals
    assert all(alike[alike[c]] == c != alike[c] for c in text_task.LETTERS)
    assert 0.37 < wrong / letters < 0.43
    state = rng.getstate()
    assert misspelled(rng, "SPOT", 0.0) == "SPOT" and rng.getstate() == state

    clean, prompts = text_batch(random.Random(1), 8, 16, 64)
    noisy, noisy_prompts = text_batch(random.Random(1), 8, 16, 64, misspell=0.5)
    assert noisy_prompts == prompts  # the captions ask for the same words ...
    assert not torch.equal(noisy, clean)  # ... the pictures draw some letters wrong
    for bad in (-0.1, 1.0):
        with pytest.raises(ConfigError, match="pretrain.misspell"):
            PretrainConfig(task="text", misspell=bad)
    with pytest.raises(ConfigError, match="pretrain.misspell is for task text"):
        PretrainConfig(misspell=0.2)


def test_text_pretraining_defaults_to_the_shipped_bases_model():
    """`spotlight pretrain --task text` with no model overrides trains the model of the shipped OCR
    base (the 16x64 strip, letter + place, no encoder layer); overrides apply on top, the shapes
    task keeps its square, and an unknown task is one ConfigError line."""
    from spotlight.pretrain import task_model
    from spotlight.recipe import load_recipe

    text, shapes = task_model("text"), task_model("shapes")
    shipped = build_model(load_recipe("ocr").model, text_task.VOCABULARY).cfg  # the checkpoint's own config
    fields = ("image_size", "image_width", "text_embedding", "text_layers", "layers", "text_dim")
    assert [getattr(text, f) for f in fields] == [getattr(shipped, f) for f in fields]
    assert text.checkpoint is None
    assert (shapes.image_size, shapes.image_width, shapes.text_embedding) == (32, 0, "token")
    wide = task_model("text", ["model.image_width=128", "model.text_embedding=token"])
    assert (wide.image_size, wide.image_width, wide.text_embedding) == (16, 128, "token")
    with pytest.raises(ConfigError, match="pretrain.task"):
        task_model("letters")


def test_text_pretraining_renders_in_worker_processes():
    """`pretrain --task text --workers N` renders the training words in N processes ahead of the
    trainer (each its own seeded stream), as the shapes task does."""
    from spotlight.models.dit import ModelConfig
    from spotlight.pretrain import PretrainConfig, batches

    canvas = ModelConfig(image_size=16, image_width=64)
    cfg = PretrainConfig(task="text", workers=2, batch_size=4, model=canvas)
    stream = batches(cfg, 16, pin=False)
    drawn = [next(stream) for _ in range(2)]
    stream.close()
    for x, prompts in drawn:
        assert x.shape == (4, 3, 16, 64)
        assert all(text_task.quoted_text(p) in text_task.TRAIN_WORDS for p in prompts)
    assert drawn[0][1] != drawn[1][1]  # two workers, two streams


def test_letter_place_embedding_is_shared_and_saved(tmp_path):
    """`model.text_embedding = 'letter_place'`: a spelled token ``"c@k`` is embedded as letter(c) +
    place(k), so what a training word teaches its letter reaches the letter at every other place;
    the checkpoint (and an export) rebuild the same encoder, and the default stays one vector per
    token."""
    from spotlight.data.scenes import VOCABULARY as SHAPES
    from spotlight.export import export, load_export

    tok = WordTokenizer(text_task.VOCABULARY)
    spelling = tok.spelling()
    assert WordTokenizer(SHAPES).spelling() is None
    assert len(spelling["tokens"]) == sum(w.startswith('"') for w in text_task.VOCABULARY)
    assert spelling["letters"] == "".join(sorted(c.lower() for c in text_task.LETTERS))

    torch.manual_seed(0)
    cfg = ModelConfig(checkpoint=None, image_size=16, image_width=64, layers=1, heads=2, head_dim=16,
                      text_layers=1, text_embedding="letter_place")
    model = build_model(cfg, text_task.VOCABULARY)
    def id_of(w: str) -> int:  # ids 0 and 1 are pad and unknown
        return 2 + tok.vocabulary.index(w)

    ids = torch.tensor([[id_of(w) for w in ('"a@-1', '"a@1', '"b@-1', '"b@1', "word")]])
    e = model.text.embed(ids)[0].detach()
    assert torch.allclose(e[0] - e[1], e[2] - e[3])  # a place is the same shift for every letter
    assert torch.equal(e[4], model.text.tokens.weight[ids[0, 4]].detach())  # other words: their own

    # a training word's gradient reaches its letters (shared), not the per-token rows
    model.encode(['the word "CAT"'])[0].square().sum().backward()
    c = spelling["letters"].index("c")
    assert model.text.letters.weight.grad[c].abs().sum() > 0
    assert model.text.tokens.weight.grad[id_of('"c@-2')].abs().sum() == 0
    model.zero_grad()

    prompts = ['the word "ZEBRA"', 'a sign that says "OWL"']
    with torch.no_grad():
        expected = model.encode(prompts)[0]
    model.save(tmp_path / "m.safetensors")
    again = build_model(ModelConfig(checkpoint=str(tmp_path / "m.safetensors")), [])
    assert again.cfg.text_embedding == "letter_place" and again.text.config["spelling"] == spelling
    export(tmp_path / "m.safetensors", tmp_path / "out")
    with torch.no_grad():
        assert torch.equal(again.encode(prompts)[0], expected)
        assert torch.equal(load_export(tmp_path / "out").encode(prompts)[0], expected)

    plain = build_model(ModelConfig(checkpoint=None, layers=1, heads=2, head_dim=16), text_task.VOCABULARY)
    assert "spelling" not in plain.text.config and not hasattr(plain.text, "letters")
    with pytest.raises(ConfigError, match="model.text_embedding must be one of"):
        ModelConfig(checkpoint=None, text_embedding="letters")
    with pytest.raises(ConfigError, match="spelled letters"):
        build_model(ModelConfig(checkpoint=None, text_embedding="letter_place"), SHAPES)


def test_text_encoder_without_layers_keeps_letters_context_free(tmp_path):
    """`model.text_layers = 0`: no transformer layer in the text encoder, so a spelled letter's
    vector is its letter + place (+ token position) whatever word it stands in — the same letter
    at the same place and token position encodes identically in two different words; the
    checkpoint rebuilds the same encoder; a negative count is one ConfigError line."""
    torch.manual_seed(0)
    cfg = ModelConfig(checkpoint=None, image_size=16, image_width=64, layers=1, heads=2, head_dim=16,
                      text_layers=0, text_embedding="letter_place")
    model = build_model(cfg, text_task.VOCABULARY)
    assert len(model.text.encoder.layers) == 0
    with torch.no_grad():
        h, mask = model.encode(['the word "CAT"', 'the word "COT"'])
    assert torch.equal(h[0, :3], h[1, :3])  # "the word" and C at its place: as in the other word
    assert not torch.equal(h[0, 3], h[1, 3])  # A against O
    assert torch.equal(h[0, 4], h[1, 4])  # T: the same, though its neighbour differs
    layered = build_model(ModelConfig(checkpoint=None, image_size=16, image_width=64, layers=1, heads=2,
                                      head_dim=16, text_layers=1, text_embedding="letter_place"),
                          text_task.VOCABULARY)
    with torch.no_grad():
        h1, _ = layered.encode(['the word "CAT"', 'the word "COT"'])
    assert not torch.equal(h1[0, 4], h1[1, 4])  # with a layer, T hears its neighbour

    model.save(tmp_path / "m.safetensors")
    again = build_model(ModelConfig(checkpoint=str(tmp_path / "m.safetensors")), [])
    assert again.cfg.text_layers == 0 and again.text.config["layers"] == 0
    with torch.no_grad():
        assert torch.equal(again.encode(['the word "CAT"'])[0], h[:1])
    with pytest.raises(ConfigError, match="model.text_layers must be >= 0"):
        ModelConfig(checkpoint=None, text_layers=-1)
