"""Pure pieces of the accuracy benchmark: English sentences written for it, text-line rendering with known ground
truth, CTC greedy decoding and the character error rate.

Only numpy is needed; rendering needs Pillow and a DejaVu font (Debian `fonts-dejavu-core`). Kept free of the model
packages so tests/test_accuracy_benchmark.py can check these pieces without any optional extra.
"""
from __future__ import annotations

from pathlib import Path
from typing import List, Sequence

import numpy as np

SENTENCES = [
    "The river turned silver just before the storm reached the valley.",
    "Quantized models trade a little accuracy for a lot of speed.",
    "Please leave the spare keys under the blue flower pot.",
    "Seven hungry geese crossed the road in perfect single file.",
    "Our train to Lisbon leaves at 8:45 from platform 12.",
    "A quiet library is the best place to finish a long report.",
    "She painted the old fence green and the gate bright yellow.",
    "The lighthouse keeper counted 214 ships during the summer.",
    "Fresh bread and strong coffee make every morning better.",
    "He forgot his umbrella, so he waited under the bridge.",
    "Each sensor reports its temperature twice per second.",
    "The museum opens late on Thursdays and closes at ten.",
    "Mountain goats climb cliffs that look impossible to us.",
    "Our team fixed three bugs and found four new ones.",
    "The recipe calls for two eggs, sugar and a pinch of salt.",
    "Wind turbines hummed softly along the northern ridge.",
    "Invoice 7731 was paid in full on the first of March.",
    "A small fox watched the campers from behind a pine tree.",
    "The violinist tuned her strings while the hall filled up.",
    "Neural networks learn patterns from many examples.",
    "Turn left at the bakery, then walk two more blocks.",
    "The harbour smelled of salt, diesel and grilled fish.",
    "Children built a snow castle with towers and a moat.",
    "Batteries last longer when they are kept cool and dry.",
    "The committee will vote on the new budget next week.",
    "Autumn leaves covered the path in red and orange.",
    "My grandmother still writes letters with a fountain pen.",
    "The satellite passed overhead at exactly 21:07 tonight.",
    "Good documentation saves hours of guessing later on.",
    "The baker opens his shop at five every single morning.",
    "A thin layer of fog hid the far side of the lake.",
    "Engineers measured the bridge after the heavy flood.",
    "Please return all library books by the end of June.",
    "The cat slept on the warm laptop while I made tea.",
    "Heavy rain delayed the football match by an hour.",
    "Every map is a simplified picture of the real world.",
    "The old clock in the hall gains a minute each day.",
    "We planted tomatoes, beans and basil along the wall.",
    "Room 305 is reserved for the design review at noon.",
    "Tiny errors can grow when they pass through many layers.",
    "The pilot announced a smooth landing in twenty minutes.",
    "Snow fell quietly on the roofs of the sleeping town.",
    "Her bicycle has a basket, a bell and a squeaky brake.",
    "The market sells apples, pears and local honey.",
    "A careful test catches problems before users do.",
    "The choir practised the same song for three evenings.",
    "Deep in the forest, an owl called twice and fell silent.",
    "The printer jammed again on page 48 of the manual.",
    "Dolphins followed the ferry almost all the way home.",
    "He measured the table twice and cut the board once.",
    "The garden gate creaks whenever the wind blows west.",
    "Clear labels make the warehouse much easier to search.",
    "Thunder rolled over the hills long after the flash.",
    "The students solved the puzzle in under ten minutes.",
    "A cold glass of water is welcome after a long walk.",
    "The new road will connect the two villages by spring.",
    "Copper wires carry the signal from the roof antenna.",
    "Our neighbour grows giant pumpkins for the fair.",
    "The night sky was full of stars and one bright planet.",
    "Keep the receipt in case the kettle stops working.",
    "Sunlight through the window warmed the wooden floor.",
    "The orchestra played the final chord and the hall cheered.",
    "Most bugs hide in the code that nobody wants to read.",
    "The bus was late, so we shared a taxi to the station.",
    "A strong password mixes letters, digits and symbols.",
    "The kettle whistled while the toast turned golden brown.",
    "Fishermen mended their nets on the stone quay.",
    "Quarterly sales rose by 6.5 percent in the east region.",
    "The hikers reached the summit just after sunrise.",
    "An empty theatre feels larger than a full one.",
]
"""Own English sentences (letters, digits, punctuation), the text of the OCR lines and of the embedding inputs."""

FONT_DIRS = ["/usr/share/fonts/truetype/dejavu", "/usr/share/fonts/dejavu", "/usr/local/share/fonts/dejavu"]
FONT_NAMES = ["DejaVuSans.ttf", "DejaVuSerif.ttf", "DejaVuSansMono.ttf", "DejaVuSans-Bold.ttf",
              "DejaVuSerif-Bold.ttf", "DejaVuSansCondensed.ttf", "DejaVuSerifCondensed.ttf", "DejaVuSans-Oblique.ttf"]


def text_lines(max_chars: int = 24, sentences: Sequence[str] = SENTENCES) -> List[str]:
    """The sentences word-wrapped into lines of at most `max_chars` characters: one 48x320 recognizer input holds
    about that many characters before PaddleOCR's resize squeezes the glyphs."""
    lines: List[str] = []
    for sentence in sentences:
        current = ""
        for word in sentence.split():
            candidate = f"{current} {word}" if current else word
            if len(candidate) <= max_chars or not current:
                current = candidate
            else:
                lines.append(current)
                current = word
        if current:
            lines.append(current)
    return lines


def find_fonts(dirs: Sequence[str] = FONT_DIRS) -> List[Path]:
    """The DejaVu fonts present, in FONT_NAMES order (empty when none is installed)."""
    found = []
    for name in FONT_NAMES:
        for d in dirs:
            path = Path(d, name)
            if path.is_file():
                found.append(path)
                break
    return found


def render_line(text: str, seed: int, fonts: Sequence[Path], height: int = 48) -> np.ndarray:
    """`text` rendered as a grey text-line crop (uint8 [h, w], h = `height`), the look varied by `seed`: font, size,
    contrast, margins, a slight rotation, blur and noise. The same (text, seed, fonts) gives the same pixels."""
    from PIL import Image, ImageDraw, ImageFilter, ImageFont

    if not fonts:
        raise ValueError("no font given (install Debian's fonts-dejavu-core)")
    rng = np.random.default_rng(seed)
    font = ImageFont.truetype(str(fonts[int(rng.integers(len(fonts)))]), int(rng.integers(26, 44)))
    bg = int(rng.integers(150, 256))
    fg = int(rng.integers(0, max(1, bg - 90)))
    left, top, right, bottom = font.getbbox(text)
    pad_x, pad_y = int(rng.integers(4, 16)), int(rng.integers(3, 10))
    img = Image.new("L", (right - left + 2 * pad_x, bottom - top + 2 * pad_y), bg)
    ImageDraw.Draw(img).text((pad_x - left, pad_y - top), text, fill=fg, font=font)
    angle = float(rng.uniform(-1.5, 1.5))
    img = img.rotate(angle, resample=Image.BICUBIC, expand=False, fillcolor=bg)
    blur = float(rng.uniform(0.0, 1.0))
    if blur > 0.3:
        img = img.filter(ImageFilter.GaussianBlur(blur))
    w = max(1, round(img.width * height / img.height))
    img = img.resize((w, height), Image.BILINEAR)
    arr = np.asarray(img, np.float32) + rng.normal(0.0, float(rng.uniform(0.0, 8.0)), (height, w))
    return np.clip(np.rint(arr), 0, 255).astype(np.uint8)


def rec_input(gray: np.ndarray, width: int = 320, height: int = 48) -> np.ndarray:
    """PaddleOCR's recognizer preprocessing of one crop: RGB, resized to `height` keeping the aspect ratio (squeezed
    to `width` when wider), (x / 255 - 0.5) / 0.5, zero-padded on the right: float32 [1, 3, height, width]."""
    from PIL import Image

    w = min(width, max(1, int(np.ceil(gray.shape[1] * height / gray.shape[0]))))
    img = np.asarray(Image.fromarray(gray).resize((w, height), Image.BILINEAR), np.float32)
    out = np.zeros((1, 3, height, width), np.float32)
    out[0, :, :, :w] = (img / 255.0 - 0.5) / 0.5
    return out


def character_list(metadata_value: str, classes: int) -> List[str]:
    """The recognizer's class labels from its metadata `character` (one per line), as PaddleOCR builds them:
    class 0 is the CTC blank, then the dictionary, then a space when the model has one more class."""
    chars = metadata_value.splitlines()
    labels = ["<blank>", *chars]
    if len(labels) == classes - 1:
        labels.append(" ")
    if len(labels) != classes:
        raise ValueError(f"{len(chars)} characters in the metadata do not match {classes} output classes")
    return labels


def ctc_greedy_decode(probs: np.ndarray, labels: Sequence[str], blank: int = 0) -> str:
    """Best path decoding of one [T, C] score matrix: the arg max per step, repeats merged, blanks dropped."""
    best = np.asarray(probs).argmax(axis=-1).reshape(-1)
    out = []
    previous = -1
    for k in best.tolist():
        if k != previous and k != blank:
            out.append(labels[k])
        previous = k
    return "".join(out)


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance (insertions, deletions, substitutions all cost 1)."""
    if len(a) < len(b):
        a, b = b, a
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, cb in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (ca != cb))
    return row[-1]


def cer(predictions: Sequence[str], references: Sequence[str]) -> float:
    """Character error rate: total edit distance over total reference characters (corpus level, so long and short
    lines weigh by their length)."""
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions for {len(references)} references")
    total = sum(len(r) for r in references)
    if total == 0:
        raise ValueError("the references hold no characters")
    return sum(edit_distance(p, r) for p, r in zip(predictions, references)) / total

