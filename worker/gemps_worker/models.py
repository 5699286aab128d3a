"""Models for the reference worker."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


def mlp(input_shape: tuple[int, ...], num_classes: int, hidden: int = 64) -> nn.Module:
    return nn.Sequential(
        nn.Flatten(), nn.Linear(math.prod(input_shape), hidden), nn.ReLU(), nn.Linear(hidden, num_classes)
    )


def wide_mlp(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """1,024 hidden units (76,810 parameters on digits), for runs across a link: its bytes outweigh
    its compute, where the digits CNN's convolutions keep two cores busy at 100 Mbit/s."""
    return mlp(input_shape, num_classes, hidden=1024)


def wider_mlp(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """4,096 hidden units (307,210 parameters on digits, 1.2 MB a float32 commit): a model whose
    bytes bound it at 100 Mbit/s even on two cores, where wide-mlp is still partly compute-bound."""
    return mlp(input_shape, num_classes, hidden=4096)


def widest_mlp(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """14,000 hidden units (1,050,010 parameters on digits, 4.2 MB a float32 commit): the 1M
    parameters of the overlap benchmark (gemps_bench.overlap), about 0.35 s a commit at 100 Mbit/s."""
    return mlp(input_shape, num_classes, hidden=14_000)


def digits_cnn(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """A small CNN for 1x8x8 digits."""
    channels = input_shape[0]
    return nn.Sequential(
        nn.Conv2d(channels, 16, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * (input_shape[1] // 2) * (input_shape[2] // 2), 64),
        nn.ReLU(),
        nn.Linear(64, num_classes),
    )


class PaperCnn(nn.Module):
    """The MNIST CNN of the GEM paper's Appendix A (its reference code's model): two 5x5
    convolutions (10 and 20 channels, dropout on the second) and three fully connected layers
    320 -> 300 -> 200 -> classes."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(320, 300)
        self.fc2 = nn.Linear(300, 200)
        self.fc3 = nn.Linear(200, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = F.relu(self.fc1(x.flatten(1)))
        x = F.relu(self.fc2(x))
        logits: torch.Tensor = self.fc3(x)  # cross_entropy applies the log-softmax
        return logits


def mnist_cnn(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    if tuple(input_shape) != (1, 28, 28):
        raise ValueError(f"mnist-cnn needs 1x28x28 images (mnist, fashion-mnist), not {list(input_shape)}")
    return PaperCnn(num_classes)


class ResidualBlock(nn.Module):
    """Two 3x3 convolutions with batch norm and an identity (or 1x1, when the shape changes) shortcut."""

    def __init__(self, channels_in: int, channels_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels_out)
        self.conv2 = nn.Conv2d(channels_out, channels_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or channels_in != channels_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(channels_in, channels_out, 1, stride=stride, bias=False), nn.BatchNorm2d(channels_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        result: torch.Tensor = F.relu(out + self.shortcut(x))
        return result


def resnet_bn(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """A small ResNet with batch norm (stem, two residual stages, global average pooling): the
    usual architecture whose running statistics must reach the server for exports to evaluate."""
    return nn.Sequential(
        nn.Conv2d(input_shape[0], 16, 3, padding=1, bias=False),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        ResidualBlock(16, 16, stride=1),
        ResidualBlock(16, 32, stride=2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, num_classes),
    )


class CausalBlock(nn.Module):
    """A pre-norm transformer block: causal multi-head self-attention, then a 4x MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, width))
        out: torch.Tensor = x + self.mlp(self.norm2(x))
        return out


class CharGpt(nn.Module):
    """A small GPT-style character language model: token and learned position embeddings, causal
    blocks, a final layer norm, and an output head tied to the token embedding (the same matrix,
    so one parameter). forward maps (N, T) token ids to logits (N, vocabulary, T): the class axis
    second, as F.cross_entropy takes it for (N, T) targets."""

    def __init__(self, vocabulary: int, context: int, width: int = 64, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocabulary, width)
        self.positions = nn.Embedding(context, width)
        self.blocks = nn.Sequential(*(CausalBlock(width, heads) for _ in range(layers)))
        self.norm = nn.LayerNorm(width)
        for module in self.modules():  # GPT-2's initialisation: small weights keep early logits near uniform
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[1], device=x.device)
        h = self.norm(self.blocks(self.tokens(x) + self.positions(positions)))
        logits: torch.Tensor = F.linear(h, self.tokens.weight)
        return logits.transpose(1, 2)


def char_gpt(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """2 layers, width 64, 4 heads over a context of input_shape[0] tokens (stdlib-text)."""
    if len(input_shape) != 1:
        raise ValueError(f"char-gpt needs token windows (stdlib-text), not inputs of shape {list(input_shape)}")
    return CharGpt(num_classes, input_shape[0])


MODELS: dict[str, Callable[[tuple[int, ...], int], nn.Module]] = {
    "mlp": mlp,
    "wide-mlp": wide_mlp,
    "wider-mlp": wider_mlp,
    "widest-mlp": widest_mlp,
    "digits-cnn": digits_cnn,
    "mnist-cnn": mnist_cnn,
    "resnet-bn": resnet_bn,
    "char-gpt": char_gpt,
}


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int, seed: int = 0) -> nn.Module:
    """Build a model with seeded initial weights (the first worker's become the central variable)."""
    try:
        factory = MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}") from None
    torch.manual_seed(seed)
    return factory(input_shape, num_classes)
