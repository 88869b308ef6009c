"""OCR reward: does the image say the quoted text of its prompt, as read by a real OCR model?

The reader is PP-OCRv4 (the PaddleOCR family Flow-GRPO's text task uses) through the
`rapidocr-onnxruntime` wheel, which ships the detection and recognition ONNX models: no download,
onnxruntime on the CPU. Two ways to read:

- **line** — recognition only: the image is one line of text (the text task's strip canvas);
- **full** — detection, then recognition of every detected box, texts joined in reading order
  (top to bottom, left to right): any image, e.g. a real pipeline's 1024² sample.
- **auto** (default) — line when the image is at least 2.5 times wider than tall, else full.

Score (Flow-GRPO's definition): target = the text between the prompt's first pair of double quotes;
both it and the text read are NFKC-normalised (the recogniser's dictionary emits full-width forms),
lower-cased and stripped of all whitespace — so case and spaces never count; score = 1 − min(d,
n) / n with d the Levenshtein distance between them and n the target's length: 1 is an exact read,
0 a read no closer than n edits. A prompt without quoted text is a ConfigError (one line).

**Where the text is right** (``columns``): besides the score, a per-column credit map [B, W] for
advantage maps (``grpo.awm_credit = "columns"``). On a line image each character read sits at its
CTC frame's column (PP-OCR's own word-box positions, ``return_word_box``); the edit alignment that
gives the score marks each read character 1 (it is the target's letter there) or 0 (a wrong or an
extra letter); every column within half a letter spacing of a read character gets that mark, and
the rest of the image — and every column of an image read in full mode or read as nothing — gets
the image's score. So a sample whose second letter is wrong is told so at that letter, not across
the word.

Scoring runs in the reward's own thread pool (onnxruntime releases the GIL): ``__call__`` splits the
batch over it and waits; ``score_async`` awaits the same work without blocking the event loop.
Knows numpy and the OCR wheel; nothing of models or actors.
"""

from __future__ import annotations

import asyncio
import threading
import unicodedata
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from spotlight.data.text import quoted_text
from spotlight.errors import ConfigError
from spotlight.rewards.base import check_batch

__all__ = ["OcrConfig", "OcrReward", "aligned_marks", "column_credit", "edit_distance", "normalize_text",
           "text_score"]

MODES = ("auto", "line", "full")
LINE_ASPECT = 2.5  # auto: an image this much wider than tall is read as one line


@dataclass(kw_only=True, slots=True, frozen=True)
class OcrConfig:
    """Settings of the OCR reward (the recipe's `[reward]` table with name = "ocr")."""

    mode: str = "auto"
    """line (recognition only) | full (detection + recognition) | auto (by aspect ratio)."""
    threads: int = 2
    """Threads of the reward's pool; each runs onnxruntime single-threaded on a slice of the batch."""
    min_confidence: float = 0.0
    """Recognised pieces at or below this confidence are dropped (Flow-GRPO keeps those > 0)."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"ocr.mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 1:
            raise ConfigError(f"ocr.threads must be an int >= 1, got {self.threads!r}")
        if not 0 <= self.min_confidence < 1:
            raise ConfigError(f"ocr.min_confidence must be in [0, 1), got {self.min_confidence}")


def normalize_text(text: str) -> str:
    """NFKC, lower case, no whitespace: the form both sides are compared in."""
    return "".join(unicodedata.normalize("NFKC", text).lower().split())


def _edit_table(a: str, b: str) -> list[list[int]]:
    """Levenshtein DP table: [i][j] = the distance between a[:i] and b[:j]."""
    d = [[i + j if i == 0 or j == 0 else 0 for j in range(len(b) + 1)] for i in range(len(a) + 1)]
    for i in range(1, len(a) + 1):
        for j in range(1, len(b) + 1):
            d[i][j] = min(d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (a[i - 1] != b[j - 1]))
    return d


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance (insertions, deletions, substitutions of one character each)."""
    return _edit_table(a, b)[-1][-1]


def text_score(read: str, target: str) -> float:
    """1 − min(d, n) / n on normalised texts (n = the target's length); see the module docstring."""
    read, target = normalize_text(read), normalize_text(target)
    if not target:
        raise ConfigError("OCR reward: the quoted text is empty")
    return 1.0 - min(edit_distance(read, target), len(target)) / len(target)


def aligned_marks(read: str, target: str) -> list[int]:
    """Per character of ``read``: 1 when a minimum edit alignment of ``read`` to ``target`` matches
    it to the same character of the target, 0 when it substitutes one or is inserted. (Texts as
    compared: normalise both first.)"""
    n, m = len(target), len(read)
    d = _edit_table(target, read)
    marks = [0] * m
    i, j = n, m
    while i > 0 and j > 0:
        if d[i][j] == d[i - 1][j - 1] + (target[i - 1] != read[j - 1]):
            marks[j - 1] = int(target[i - 1] == read[j - 1])
            i, j = i - 1, j - 1
        elif d[i][j] == d[i][j - 1] + 1:
            j -= 1  # read[j - 1] is an extra character: mark 0
        else:
            i -= 1  # a target letter never read: it has no column, the image's score covers it
    return marks


def column_credit(
    read: str, xs: list[float], target: str, width: int, score: float | None = None
) -> np.ndarray:
    """float32 [width]: the credit map of one line image (module docstring). ``read`` is the text
    as recognised, ``xs`` the column of each of its characters (same length); ``score`` its
    ``text_score`` when the caller has it."""
    if len(xs) != len(read):
        raise ValueError(f"{len(read)} characters read but {len(xs)} positions")
    chars, at = [], []
    for ch, x in zip(read, xs):  # normalise per character, keeping each one's column
        for c in normalize_text(ch):
            chars.append(c)
            at.append(float(x))
    out = np.full(width, text_score(read, target) if score is None else score, dtype=np.float32)
    if not chars:
        return out
    marks = aligned_marks("".join(chars), normalize_text(target))
    at_arr = np.asarray(at)
    gaps = np.diff(np.sort(at_arr))
    reach = float(np.median(gaps)) / 2 if len(gaps) and np.median(gaps) > 0 else width / (2 * len(target))
    cols = np.arange(width) + 0.5
    dist = np.abs(cols[:, None] - at_arr[None, :])  # [width, chars]
    nearest = dist.argmin(1)
    near = dist[np.arange(width), nearest] <= reach
    out[near] = np.asarray(marks, dtype=np.float32)[nearest[near]]
    return out


_ENGINE_LOCK = threading.Lock()
_ENGINE = None


def _engine():
    """One RapidOCR engine per process (its ONNX sessions are safe to run from several threads)."""
    global _ENGINE
    with _ENGINE_LOCK:
        if _ENGINE is None:
            try:
                from rapidocr_onnxruntime import RapidOCR
            except ImportError as e:
                raise ConfigError(f"OCR reward needs the rapidocr-onnxruntime package: {e}") from None
            _ENGINE = RapidOCR(intra_op_num_threads=1, inter_op_num_threads=1)
        return _ENGINE


class OcrReward:
    """Reward = how closely PP-OCRv4 reads the prompt's quoted text; see the module docstring."""

    name = "ocr"

    def __init__(self, config: OcrConfig | None = None, *, mode: str | None = None,
                 threads: int | None = None, min_confidence: float | None = None) -> None:
        given = {k: v for k, v in (("mode", mode), ("threads", threads), ("min_confidence", min_confidence))
                 if v is not None}
        if config is not None and given:
            raise ConfigError("pass either an OcrConfig or mode/threads/min_confidence, not both")
        self.config = config or OcrConfig(**given)
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    # --- reading -------------------------------------------------------------------------------
    def read(self, images: np.ndarray) -> list[str]:
        """The text read in each uint8 [H, W, 3] image, as recognised (``text_score`` normalises it),
        in the pool, in order."""
        return [t for f in self._submit(images) for t, _ in f.result()]

    def _read_slice(self, images: np.ndarray) -> list[tuple[str, list[float] | None]]:
        """(text, the column of each of its characters) per image; None for full-mode reads."""
        engine = _engine()
        bgr = [np.ascontiguousarray(img[:, :, ::-1]) for img in images]  # the engine expects BGR
        lines = [i for i, img in enumerate(images) if self._is_line(img)]
        out: list[tuple[str, list[float] | None]] = [("", None)] * len(images)
        if lines:
            recognised, _ = engine.text_rec([bgr[i] for i in lines], return_word_box=True)
            for i, (text, conf, boxes) in zip(lines, recognised):
                if conf <= self.config.min_confidence:
                    out[i] = ("", [])
                    continue
                # boxes: [CTC frames over the image, words, each word's frame per character, ...];
                # a character's frame f covers columns from f·W/frames; its centre is ~one frame on
                frames, width = float(boxes[0]), images[i].shape[1]
                xs = [(f + 1.0) * width / frames for word in boxes[2] for f in word]
                out[i] = (text, xs if len(xs) == len(text) else None)
        for i in sorted(set(range(len(images))) - set(lines)):
            found, _ = engine(bgr[i], use_det=True, use_cls=False, use_rec=True)
            out[i] = ("".join(t for _, t, c in (found or []) if float(c) > self.config.min_confidence), None)
        return out

    def _is_line(self, img: np.ndarray) -> bool:
        if self.config.mode != "auto":
            return self.config.mode == "line"
        return img.shape[1] >= LINE_ASPECT * img.shape[0]

    def _submit(self, images: np.ndarray) -> list[Future]:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.config.threads, thread_name_prefix="ocr-reward")
        slices = np.array_split(np.arange(len(images)), min(self.config.threads, max(1, len(images))))
        return [self._pool.submit(self._read_slice, images[s]) for s in slices if len(s)]

    # --- scoring -------------------------------------------------------------------------------
    def __call__(self, images: np.ndarray, prompts: list[str]) -> np.ndarray:
        targets = self._targets(images, prompts)
        return self._scores(self.read(images), targets)

    async def score_async(self, images: np.ndarray, prompts: list[str]) -> np.ndarray:
        """As ``__call__``, awaited: the event loop keeps running while the pool reads."""
        targets = self._targets(images, prompts)
        parts = await asyncio.gather(*(asyncio.wrap_future(f) for f in self._submit(images)))
        return self._scores([t for p in parts for t, _ in p], targets)

    def columns(self, images: np.ndarray, prompts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(scores float32 [B], per-column credit float32 [B, W]); see the module docstring."""
        targets = self._targets(images, prompts)
        return self._columns([r for f in self._submit(images) for r in f.result()], targets, images.shape[2])

    async def columns_async(self, images: np.ndarray, prompts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """As ``columns``, awaited."""
        targets = self._targets(images, prompts)
        parts = await asyncio.gather(*(asyncio.wrap_future(f) for f in self._submit(images)))
        return self._columns([r for p in parts for r in p], targets, images.shape[2])

    def _columns(self, reads, targets: list[str], width: int) -> tuple[np.ndarray, np.ndarray]:
        scores = self._scores([t for t, _ in reads], targets)
        maps = np.empty((len(targets), width), dtype=np.float32)
        for k, ((text, xs), target) in enumerate(zip(reads, targets)):
            maps[k] = scores[k] if xs is None else column_credit(text, xs, target, width, float(scores[k]))
        return scores, maps

    @staticmethod
    def _targets(images: np.ndarray, prompts: list[str]) -> list[str]:
        check_batch(images, prompts)
        return [quoted_text(p) for p in prompts]  # bad prompts fail before any reading

    @staticmethod
    def _scores(read: list[str], targets: list[str]) -> np.ndarray:
        return np.array([text_score(r, t) for r, t in zip(read, targets)], dtype=np.float32)

    def close(self) -> None:
        """Shut the reward's thread pool down (a later call starts a new one)."""
        with self._pool_lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None

    def __repr__(self) -> str:
        return f"OcrReward(mode={self.config.mode!r}, threads={self.config.threads})"
