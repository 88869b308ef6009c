"""Prompt sets: the whole caption grammar (pretraining), named training sets for RL runs, and
their held-out splits.

RL on a 2-core CPU has minutes, so a run trains on a small fixed prompt set. Its headline
evaluation is on the *held-out* split (`heldout_prompts`): prompts of the same grammar — the same
colours, shapes, counts and relations in other combinations — that no RL run of that set ever
trains on, so a rise there is a skill, not a memorised prompt. The training prompts are evaluated
too, with unseen seeds.
"""

from __future__ import annotations

import itertools
import random

from spotlight.data import text as text_task
from spotlight.data.scenes import PALETTE, RELATIONS, SHAPES, ObjectGroup, Scene
from spotlight.errors import ConfigError


def all_captions() -> list[str]:
    """Every caption of the grammar, in a fixed order."""
    colors = list(PALETTE)
    single = [Scene((ObjectGroup(c, s, n),)) for n in (1, 2, 3) for c in colors for s in SHAPES]
    pairs = [
        Scene((ObjectGroup(c1, s1, 1), ObjectGroup(c2, s2, 1)), rel)
        for c1, c2 in itertools.permutations(colors, 2)
        for s1, s2 in itertools.product(SHAPES, SHAPES)
        for rel in RELATIONS
    ]
    return [s.caption() for s in single + pairs]


PROMPT_SETS: dict[str, list[str]] = {
    # Counting and relations are what the base model gets wrong most; colours it mostly gets right.
    "demo": [
        "two red circles",
        "three blue squares",
        "three yellow circles",
        "two green triangles",
        "a red circle to the left of a blue square",
        "a green square above a yellow circle",
        "a blue triangle to the right of a yellow square",
        "a yellow circle below a red square",
    ],
    "counting": [f"{n} {c} {s}s" for n in ("two", "three") for c in PALETTE for s in SHAPES],
}



def _broad() -> list[str]:
    """The demo prompts first, then every other single-group caption and as many relation captions
    (a fixed sample), none of the demo's held-out split: 64 prompts, half counts, half relations."""
    held = set(HELDOUT["demo"])
    demo = PROMPT_SETS["demo"]
    rest = [c for c in all_captions() if c not in held and c not in demo]
    singles = [c for c in rest if " of " not in c and " above " not in c and " below " not in c]
    pairs = [c for c in rest if c not in singles]
    return demo + singles + random.Random(0).sample(pairs, len(singles))  # demo: 4 counts, 4 relations


HELDOUT: dict[str, list[str]] = {
    # Same mix as "demo" (four counts, four relations; every colour, shape and relation appears in
    # training), none of them a training prompt.
    "demo": [
        "two blue triangles",
        "three red squares",
        "two yellow squares",
        "three green circles",
        "a blue circle to the left of a green triangle",
        "a red square above a blue circle",
        "a yellow triangle to the right of a green square",
        "a green circle below a red triangle",
    ],
}
HELDOUT["broad"] = HELDOUT["demo"]
# The text-rendering task (spotlight.data.text): every training word in a fixed shuffled order (so
# the first 8, which evaluations sample, mix word lengths); held out: the disjoint word list.
PROMPT_SETS["words"] = text_task.word_prompts(random.Random(0).sample(text_task.TRAIN_WORDS,
                                                                      len(text_task.TRAIN_WORDS)))
HELDOUT["words"] = text_task.word_prompts(text_task.HELDOUT_WORDS)
PROMPT_SETS["broad"] = _broad()  # more combinations of the same words: skills, not memorised prompts


def heldout_prompts(name: str, n: int = 8) -> list[str]:
    """The held-out split of training set `name`: prompts of the grammar it never contains.

    Named sets have a fixed split; any other set gets `n` captions of the grammar outside it, in a
    fixed order (none for 'all', which is the whole grammar).
    """
    train = set(prompt_set(name))
    if name in HELDOUT:
        return list(HELDOUT[name])
    rest = [c for c in all_captions() if c not in train]
    return random.Random(0).sample(rest, min(n, len(rest)))


def eval_train_prompts(name: str, n: int = 8) -> list[str]:
    """The training prompts an evaluation samples: the first `n` of the set (for 'broad', the demo
    prompts), so evaluations stay affordable and comparable across sets."""
    return prompt_set(name)[:n]


def prompt_set(name: str) -> list[str]:
    if name == "all":
        return all_captions()
    if name not in PROMPT_SETS:
        raise ConfigError(f"data.prompts: unknown prompt set {name!r}; known: all, {', '.join(PROMPT_SETS)}")
    return list(PROMPT_SETS[name])
