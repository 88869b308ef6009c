"""The text-rendering task: a prompt grammar with quoted words, word lists, a font and a renderer.

A prompt asks for one word in capitals inside double quotes (`a sign that says "SPOT"`), like
Flow-GRPO's OCR prompts. Words of 3–6 letters come from a fixed training list (`TRAIN_WORDS`,
pretraining and RL) and a disjoint held-out list (`HELDOUT_WORDS`, evaluation only), so a rise on
held-out words is a skill — drawing letters — not a memorised word. `render` draws the word black on
white, one letter per fixed-width cell, centred, in the shipped font (Pillow's own default font, a
TrueType face since Pillow 10.1). `quoted_text` pulls the asked-for text back out of a prompt, for
the OCR reward. This module knows nothing of models, training or rewards.
"""

from __future__ import annotations

import random
import re
from functools import lru_cache

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from spotlight.errors import ConfigError
from spotlight.models.text import spelled_token

MAX_LETTERS = 6
TEMPLATES = ('a sign that says "{}"', 'the word "{}"', 'a label reading "{}"')

# Common English words, 3-6 letters, capitals. The two lists are disjoint (a test holds it) and
# every letter of a held-out word appears at the same place in some training word.
TRAIN_WORDS: tuple[str, ...] = tuple(
    """
    ACT AGE AIR ANT ARM ART ASK BAG BAT BED BEE BIG BOX BOY BUS CAR CAT COW CUP CUT DAY DOG DRY EAR
    EAT EGG END EYE FAN FAR FIG FIX FLY FOX FUN GAS GOT GUM HAT HEN HOT ICE INK JAM JAR JET JOB JOY
    KEY KID LAP LEG LID LOG MAP MIX MUD NET NUT OAK OIL OWL PAN PEN PET PIG PIN POT RAT RED ROW RUG
    RUN SAD SEA SKY SUN TAX TEA TOP TOY VAN WAX WEB WIN YAK ZIP ZOO
    ARCH AUNT BABY BAKE BALL BAND BANK BARN BATH BEAR BELL BIRD BLUE BOAT BONE BOOK BOWL CAKE CALM
    CAMP CARD CAVE CHIP CITY CLAY COAT COIN COLD CORN CRAB DARK DEER DESK DISH DOOR DOVE DRUM DUCK
    DUST EAST ECHO EDGE FACE FARM FERN FIRE FISH FLAG FOAM FOOD FORK FROG GATE GIFT GOAT GOLD GOLF
    GRIN HAIR HALL HAND HARP HILL HOME HOOK HOPE HORN JAZZ JUMP KING KITE KNOT LAKE LAMP LEAF LION
    LOCK MAIL MASK MILK MINT MIST MOTH NAIL NEST NOTE OVEN PARK PEAR PINK PLUM POEM POND QUIZ RAIN
    ROAD ROCK ROOF ROPE ROSE SAIL SALT SAND SHIP SHOE SNOW SOAP SOCK SOUP STAR SWAN TAIL TENT TIDE
    TREE VASE VINE WALL WAVE WIND WOLF WOOD WORM YARN ZERO
    APPLE BEACH BENCH BERRY BLOCK BRAVE BREAD BRICK BROOM BRUSH CANDY CHAIR CHALK CHESS CLOCK CLOUD
    CORAL CRANE CROWN DAISY DANCE DREAM EAGLE EARTH FEAST FIELD FLAME FLUTE FROST FRUIT GHOST GLASS
    GLOVE GRAPE GRASS HEART HONEY HORSE HOUSE JELLY JEWEL JUICE KNIFE LEMON LIGHT MANGO MAPLE MONEY
    MOUSE MUSIC NIGHT NOVEL OCEAN OLIVE ONION PAINT PAPER PEACH PEARL PIANO PILOT PLANT PLATE QUEEN
    QUIET RADIO RIVER ROBOT SCARF SHEEP SHELL SKATE SMILE SNAKE SPOON STONE STORM SUGAR TABLE TIGER
    TOAST TOWER TRAIN TRUCK VOICE WATER WHALE WHEAT WORLD YOUTH ZEBRA
    ANCHOR BASKET BOTTLE BRIDGE BUTTER CAMERA CANDLE CASTLE CIRCLE COFFEE COOKIE COPPER DESERT
    DINNER DRAGON FLOWER FOREST GARDEN GUITAR HAMMER HELMET ISLAND JACKET JUNGLE KETTLE LADDER
    LIZARD MARKET MIRROR MONKEY NEEDLE ORANGE PARROT PENCIL PEPPER PICNIC PILLOW PLANET POCKET
    PUZZLE RABBIT ROCKET SADDLE SHADOW SILVER SPIDER SPRING SQUARE STREAM SUMMER TEMPLE TICKET
    TOMATO TUNNEL VALLEY VELVET WINDOW WINTER YELLOW BLAZE LEGEND
    """.split()
)
HELDOUT_WORDS: tuple[str, ...] = tuple(
    "BUG ELK HAM WET BEAM CLIP GRAY MOON SPOT TOWN BLANK CHARM PRIZE SPARK BORDER MAGNET".split()
)
LETTERS = tuple("ABCDEFGHIJKLMNOPQRSTUVWXYZ")
LOOKALIKE: dict[str, str] = {a: b for pair in "AH BD CG EF IL JT KX MN OQ PR SZ UV WY".split()
                             for a, b in (pair, pair[::-1])}
"""Each capital's look-alike (a pairing: B for D and D for B), the letter a misspelling base draws
instead (`spotlight pretrain --misspell`)."""
VOCABULARY: tuple[str, ...] = tuple(
    sorted({w for t in TEMPLATES for w in t.replace('"{}"', "").split()})
) + tuple(spelled_token(c.lower(), k) for c in LETTERS for k in range(1 - MAX_LETTERS, MAX_LETTERS))
"""Tokens of the text task: the template words, then one token per (letter, offset from the word's
centre in half letters): the word tokenizer spells quoted text as `"s@-3 "p@-1 "o@1 "t@3`, so an
unseen word is still spelled out, and every (letter, offset) of a held-out word occurs in training
words (a test holds it)."""

_QUOTED = re.compile(r'"([^"]*)"')


def quoted_text(prompt: str) -> str:
    """The text between the first pair of double quotes; ConfigError if there is none."""
    found = _QUOTED.search(prompt)
    if found is None or not found.group(1).strip():
        raise ConfigError(
            f'OCR reward: prompt {prompt!r} has no quoted text (write e.g. a sign that says "SPOT")'
        )
    return found.group(1)


def prompt_for(word: str, template: int = 0) -> str:
    return TEMPLATES[template % len(TEMPLATES)].format(word)


def word_prompts(words: tuple[str, ...] | list[str]) -> list[str]:
    """One prompt per word (templates in turn); ConfigError on an empty list or a bad word."""
    if not words:
        raise ConfigError("text task: the word list is empty")
    for w in words:
        if not (3 <= len(w) <= MAX_LETTERS and all(c in LETTERS for c in w)):
            raise ConfigError(f"text task: word {w!r} must be 3-{MAX_LETTERS} capital letters A-Z")
    return [prompt_for(w, i) for i, w in enumerate(words)]


@lru_cache(maxsize=8)
def load_font(path: str | None, size: int) -> ImageFont.FreeTypeFont:
    """The TrueType face at `path`, or Pillow's default font when None; ConfigError if it won't load."""
    try:
        font = ImageFont.load_default(size=size) if path is None else ImageFont.truetype(path, size)
    except (OSError, ValueError) as e:
        raise ConfigError(f"text task: font {path or 'default'!r} does not load: {e}") from None
    if not isinstance(font, ImageFont.FreeTypeFont):
        raise ConfigError("text task: Pillow's default font is a bitmap here (needs Pillow >= 10.1)")
    return font


def render_word(word: str, height: int, width: int, font_path: str | None = None) -> np.ndarray:
    """`word` black on white, one letter per cell of width // 6, centred: uint8 [H, W, 3]."""
    font = load_font(font_path, max(6, round(height * 0.875)))
    img = Image.new("RGB", (width, height), (255, 255, 255))
    draw = ImageDraw.Draw(img)
    cell = width / MAX_LETTERS
    x0 = (width - cell * len(word)) / 2
    for i, ch in enumerate(word):
        draw.text((x0 + cell * (i + 0.5), height / 2), ch, font=font, fill=(0, 0, 0), anchor="mm")
    return np.asarray(img, dtype=np.uint8)


def random_prompt(rng: random.Random, words: tuple[str, ...] = TRAIN_WORDS) -> tuple[str, str]:
    """(prompt, word) of a random training word and template."""
    word = rng.choice(words)
    return prompt_for(word, rng.randrange(len(TEMPLATES))), word
