"""The character LM (char-gpt) and its offline text (stdlib-text): shapes, causality, the tied
head, the split by file, and held-out loss per character."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from gemps_worker.held_out import evaluate
from gemps_worker.models import build_model
from gemps_worker.text_data import CONTEXT, VOCABULARY, encode, split_text, stdlib_files, stdlib_text, unigram_entropy
from tests.unit.test_models import train_losses


def test_the_lm_maps_token_windows_to_logits_with_classes_second_and_learns() -> None:
    model = build_model("char-gpt", (CONTEXT,), VOCABULARY, seed=0)
    x = torch.randint(0, VOCABULARY, (8, CONTEXT))
    y = torch.roll(x, -1, dims=1)
    assert model(x).shape == (8, VOCABULARY, CONTEXT)
    losses = train_losses(model, x, y, steps=8, lr=0.3, momentum=0.9)
    assert losses[0] == pytest.approx(math.log(VOCABULARY), abs=0.05)  # small initial weights: uniform
    assert losses[-1] < losses[0] - 0.1


def test_the_lm_is_causal_and_its_head_is_the_token_embedding() -> None:
    model = build_model("char-gpt", (CONTEXT,), VOCABULARY, seed=0).eval()
    x = torch.randint(0, VOCABULARY, (1, CONTEXT))
    changed = x.clone()
    changed[0, 40] = (x[0, 40] + 1) % VOCABULARY
    with torch.no_grad():
        before, after = model(x), model(changed)
    torch.testing.assert_close(before[..., :40], after[..., :40])  # no position sees a later one
    assert not torch.allclose(before[..., 40:], after[..., 40:])
    # One (vocabulary, width) matrix: the embedding, used again as the output head.
    assert [name for name, p in model.named_parameters() if p.shape[0] == VOCABULARY] == ["tokens.weight"]


def test_the_lm_refuses_image_inputs() -> None:
    with pytest.raises(ValueError, match="token windows"):
        build_model("char-gpt", (1, 8, 8), 10)


def write_files(folder: Path, count: int) -> list[Path]:
    for i in range(count):
        (folder / f"m{i:02d}.py").write_text(f"# file {i}\n" + "x = 1\n" * 20)
    (folder / "notes.txt").write_text("not python")
    return stdlib_files(folder)


def test_every_tenth_file_is_held_out(tmp_path: Path) -> None:
    files = write_files(tmp_path, 20)
    assert [f.name for f in files] == [f"m{i:02d}.py" for i in range(20)]  # sorted, .py only
    train, held = split_text(files)
    held_text = "".join(f.read_text() for f in (files[9], files[19]))
    np.testing.assert_array_equal(held, encode(held_text.encode()))
    assert len(train) + len(held) == sum(f.stat().st_size for f in files)


def test_too_few_files_is_an_error_naming_the_folder(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        stdlib_text(tmp_path)


def test_vocabulary_maps_printable_ascii_newline_tab_and_the_rest_to_other() -> None:
    tokens = encode("a\n\t~ é".encode())
    assert tokens.tolist() == [ord("a") - 29, 1, 2, ord("~") - 29, 3, 0, 0]  # é: two bytes, both OTHER
    assert int(encode(bytes(range(256))).max()) == VOCABULARY - 1


def test_targets_are_the_inputs_shifted_by_one_character(tmp_path: Path) -> None:
    train_x, train_y, test_x, test_y = stdlib_text(write_root(tmp_path))
    assert train_x.shape[1] == CONTEXT and train_x.dtype == np.int64
    np.testing.assert_array_equal(train_x[:, 1:], train_y[:, :-1])
    np.testing.assert_array_equal(test_x[:, 1:], test_y[:, :-1])
    np.testing.assert_array_equal(train_x[1:, 0], train_y[:-1, -1])  # windows tile the text


def write_root(folder: Path) -> Path:
    write_files(folder, 30)
    return folder


def test_unigram_entropy_is_that_of_the_character_frequencies() -> None:
    assert unigram_entropy(np.array([[3, 3, 4, 4]])) == pytest.approx(math.log(2))


def test_held_out_loss_and_accuracy_are_per_character() -> None:
    """For text, evaluate's figures are means over every predicted character (nats per
    character), not sums per window."""
    model = build_model("char-gpt", (CONTEXT,), VOCABULARY, seed=0)
    x = np.random.default_rng(0).integers(0, VOCABULARY, (5, CONTEXT))
    y = np.roll(x, -1, axis=1)
    loss, accuracy = evaluate(model, x, y, batch_size=2)
    with torch.no_grad():
        logits = model(torch.from_numpy(x))
    expected = float(F.cross_entropy(logits, torch.from_numpy(y)))
    assert loss == pytest.approx(expected, rel=1e-5)
    assert accuracy == pytest.approx(float((logits.argmax(dim=1) == torch.from_numpy(y)).float().mean()))
