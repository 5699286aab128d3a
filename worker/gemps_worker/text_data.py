"""Text available offline: the source of Python's standard library, as next-character windows.

The files are the top-level `*.py` modules of `sysconfig.get_paths()["stdlib"]`, sorted by name;
every tenth file (by that order) is held out, so held-out text is code the model never read.
Characters map to a vocabulary of 98 tokens: newline, tab, the 95 printable ASCII characters, and
one token for any other byte. A sample is a window of CONTEXT characters (int64 token ids) and its
targets, the same window shifted by one character, so a language model's loss per sample is the
mean over CONTEXT next-character predictions, in nats per character.

The text differs between Python versions, so figures are comparable only on the same version.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np

#: characters a sample sees (the model's context); each has its next character as target
CONTEXT = 64
#: every HELD_OUT_EVERY-th file (sorted order) is held out
HELD_OUT_EVERY = 10
#: held-out windows, evenly spread over the held-out files' text (kept small: it is evaluated often)
HELD_OUT_WINDOWS = 512
OTHER = 0  # any byte outside the printable ASCII range, newline and tab
VOCABULARY = 98


def _byte_table() -> np.ndarray:
    table = np.full(256, OTHER, dtype=np.int64)
    table[ord("\n")] = 1
    table[ord("\t")] = 2
    table[32:127] = np.arange(3, 98)
    return table


BYTE_TO_TOKEN = _byte_table()


def stdlib_files(root: Path | None = None) -> list[Path]:
    """The standard library's top-level modules, sorted: the same list for every worker."""
    folder = root if root is not None else Path(sysconfig.get_paths()["stdlib"])
    files = sorted(folder.glob("*.py"))
    if len(files) < HELD_OUT_EVERY:
        raise FileNotFoundError(f"too few Python files under {folder} for the stdlib-text dataset ({len(files)})")
    return files


def encode(text: bytes) -> np.ndarray:
    """Token ids of `text`'s bytes."""
    tokens: np.ndarray = BYTE_TO_TOKEN[np.frombuffer(text, dtype=np.uint8)]
    return tokens


def windows(tokens: np.ndarray, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, targets), each (len(starts), CONTEXT): the windows at `starts` and their next characters."""
    offsets = starts[:, None] + np.arange(CONTEXT)[None, :]
    return tokens[offsets], tokens[offsets + 1]


def split_bytes(files: list[Path]) -> tuple[bytes, bytes]:
    """(training text, held-out text): the files concatenated, held out by file."""
    train = [f.read_bytes() for i, f in enumerate(files) if i % HELD_OUT_EVERY != HELD_OUT_EVERY - 1]
    held = [f.read_bytes() for i, f in enumerate(files) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1]
    return b"".join(train), b"".join(held)


def split_text(files: list[Path]) -> tuple[np.ndarray, np.ndarray]:
    """(training tokens, held-out tokens): the files concatenated, held out by file."""
    train, held = split_bytes(files)
    return encode(train), encode(held)


def stdlib_text(root: Path | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(train_x, train_y, test_x, test_y): training windows tile the training text (stride
    CONTEXT), held-out windows are HELD_OUT_WINDOWS evenly spread over the held-out text."""
    train, held = split_text(stdlib_files(root))
    train_x, train_y = windows(train, np.arange(0, len(train) - CONTEXT - 1, CONTEXT))
    test_starts = np.linspace(0, len(held) - CONTEXT - 1, HELD_OUT_WINDOWS).astype(np.int64)
    test_x, test_y = windows(held, test_starts)
    return train_x, train_y, test_x, test_y


def unigram_entropy(targets: np.ndarray) -> float:
    """Entropy in nats of the targets' character frequencies: the loss of the best model that
    ignores context, a bound any language model that learned something beats."""
    counts = np.bincount(targets.ravel(), minlength=VOCABULARY).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())
