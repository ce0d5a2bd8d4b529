"""Small random conv graphs covering the structures channel pruning must handle."""

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import fx, nn

from compressor.cnn.models import export_module, save_program


class Bottleneck(nn.Module):
    def __init__(self, channels: int, inner: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, inner, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(inner)
        self.conv2 = nn.Conv2d(inner, inner, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(inner)
        self.conv3 = nn.Conv2d(inner, channels, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(channels)

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        return F.relu(self.bn3(self.conv3(y)) + x)


class BottleneckNet(nn.Module):
    """ResNet with bottleneck blocks: units conv1 -> conv2 and conv2 -> conv3 inside each block."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(16)
        self.block1 = Bottleneck(16, 12)
        self.block2 = Bottleneck(16, 8)
        self.fc = nn.Linear(16, 5)

    def forward(self, x):
        x = F.relu(self.bn(self.stem(x)))
        x = self.block2(self.block1(x))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


class InvertedResidual(nn.Module):
    def __init__(self, channels: int, expand: int) -> None:
        super().__init__()
        hidden = channels * expand
        self.expand = nn.Conv2d(channels, hidden, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(hidden)
        self.dw = nn.Conv2d(hidden, hidden, 3, padding=1, groups=hidden, bias=False)
        self.bn2 = nn.BatchNorm2d(hidden)
        self.project = nn.Conv2d(hidden, channels, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(channels)

    def forward(self, x):
        y = F.relu6(self.bn1(self.expand(x)))
        y = F.relu6(self.bn2(self.dw(y)))
        return self.bn3(self.project(y)) + x


class MobileNetish(nn.Module):
    """MobileNetV2 inverted residuals (unit expand -> depthwise -> project) and a MobileNetV1
    depthwise-separable block (unit pointwise -> depthwise -> pointwise)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, stride=2, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.ir1 = InvertedResidual(8, 3)
        self.ir2 = InvertedResidual(8, 2)
        self.pw1 = nn.Conv2d(8, 12, 1, bias=False)
        self.pw1_bn = nn.BatchNorm2d(12)
        self.dw = nn.Conv2d(12, 12, 3, padding=1, groups=12, bias=True)
        self.dw_bn = nn.BatchNorm2d(12)
        self.pw2 = nn.Conv2d(12, 10, 1, bias=False)
        self.fc = nn.Linear(10, 4)

    def forward(self, x):
        x = F.relu6(self.bn(self.stem(x)))
        x = self.ir2(self.ir1(x))
        x = F.relu(self.pw1_bn(self.pw1(x)))
        x = F.relu(self.dw_bn(self.dw(x)))
        x = self.pw2(x)
        return self.fc(x.mean((2, 3)))


class FoldedPadNet(nn.Module):
    """BatchNorm folded into conv biases, and explicit F.pad between convs."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 10, 3, padding=1)
        self.conv2 = nn.Conv2d(10, 14, 3)  # padded explicitly
        self.conv3 = nn.Conv2d(14, 6, 3, stride=2)
        self.fc = nn.Linear(6, 3)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.pad(x, (1, 1, 1, 1))
        x = F.silu(self.conv2(x))
        x = F.pad(x, (0, 1, 0, 1), mode="constant", value=0.0)
        x = torch.relu(self.conv3(x))
        return self.fc(x.mean((2, 3)))


class OptionABlock(nn.Module):
    """A CIFAR ResNet basic block (He et al. 2016, sec. 4.2) with the option-A shortcut: a stride-2
    subsample plus zero channels before and after, when the block changes width."""

    def __init__(self, inp: int, out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inp, out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out)
        self.conv2 = nn.Conv2d(out, out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out)
        self.pad = (out - inp) // 2 if stride != 1 or inp != out else None

    def forward(self, x):
        y = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))
        shortcut = x if self.pad is None else F.pad(x[:, :, ::2, ::2], (0, 0, 0, 0, self.pad, self.pad))
        return F.relu(y + shortcut)


class OptionANet(nn.Module):
    """Two stages (8 and 16 channels) of option-A basic blocks, global pooling and a Linear classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.layer1 = nn.Sequential(OptionABlock(8, 8, 1), OptionABlock(8, 8, 1))
        self.layer2 = nn.Sequential(OptionABlock(8, 16, 2), OptionABlock(16, 16, 1))
        self.linear = nn.Linear(16, 5)

    def forward(self, x):
        x = self.layer2(self.layer1(F.relu(self.bn1(self.conv1(x)))))
        return self.linear(F.adaptive_avg_pool2d(x, 1).flatten(1))


class NamedPaddingNet(nn.Module):
    """Convs with padding="same" (odd kernels, dilated too) and "valid", as EfficientNet-style exports write
    them (aten.conv2d.padding)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 12, 3, padding="same")
        self.conv2 = nn.Conv2d(12, 10, 3, padding="valid", dilation=2)
        self.conv3 = nn.Conv2d(10, 8, 5, padding="same")
        self.fc = nn.Linear(8, 3)

    def forward(self, x):
        x = torch.relu(self.conv2(torch.relu(self.conv1(x))))
        return self.fc(F.silu(self.conv3(x)).mean((2, 3)))


class FlattenedHeadNet(nn.Module):
    """Pooled features flattened with the channel count written out, as HF EfficientNet's classifier input is
    (`reshape(batch, 16)`): surgery must rewrite that constant with the channels kept."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 12, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(12)
        self.conv2 = nn.Conv2d(12, 16, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(16)
        self.fc = nn.Linear(16, 3)

    def forward(self, x):
        x = torch.relu(self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))
        return self.fc(F.adaptive_avg_pool2d(x, 1).reshape(x.shape[0], 16))


class ConvNextBlock(nn.Module):
    """ConvNeXt's block as Hugging Face writes it: depthwise 7 x 7, permute to channels-last, LayerNorm over the
    channels, Linear -> GELU -> Linear at every position, a per-channel layer scale, permute back, residual add."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.dwconv = nn.Conv2d(channels, channels, 7, padding=3, groups=channels)
        self.norm = nn.LayerNorm(channels)
        self.pwconv1 = nn.Linear(channels, 4 * channels)
        self.pwconv2 = nn.Linear(4 * channels, channels)
        self.gamma = nn.Parameter(torch.full((channels,), 0.5))  # trained scales are far above the 1e-6 init

    def forward(self, x):
        y = self.norm(self.dwconv(x).permute(0, 2, 3, 1))
        y = self.gamma * self.pwconv2(F.gelu(self.pwconv1(y)))
        return x + y.permute(0, 3, 1, 2)


class ConvNextish(nn.Module):
    """A conv stem, two ConvNeXt blocks, pooled LayerNorm and a classifier: only the blocks' inner Linear
    neurons are prunable (the stream is normalised over its channels)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 2, stride=2)
        self.blocks = nn.Sequential(ConvNextBlock(8), ConvNextBlock(8))
        self.norm = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 3)

    def forward(self, x):
        return self.fc(self.norm(self.blocks(self.stem(x)).mean((-2, -1))))


def relu6(x):
    return torch.clamp(x, 0, 6)  # how exported MobileNetV2s often write ReLU6


class MobileV2Block(nn.Module):
    """A MobileNetV2 inverted residual with ReLU6 as clamp(0, 6); optionally a squeeze-excitation
    (sigmoid gate, a product with an activation) and hardswish."""

    def __init__(self, inp: int, out: int, stride: int, expand: int, excite: bool = False) -> None:
        super().__init__()
        hidden = inp * expand
        self.expand = nn.Conv2d(inp, hidden, 1, bias=False) if expand != 1 else None
        self.bn1 = nn.BatchNorm2d(hidden) if expand != 1 else None
        self.dw = nn.Conv2d(hidden, hidden, 3, stride, 1, groups=hidden, bias=False)
        self.bn2 = nn.BatchNorm2d(hidden)
        self.excite = nn.Sequential(nn.Conv2d(hidden, max(2, hidden // 4), 1), nn.ReLU(),
                                    nn.Conv2d(max(2, hidden // 4), hidden, 1)) if excite else None
        self.project = nn.Conv2d(hidden, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.residual = stride == 1 and inp == out

    def forward(self, x):
        y = relu6(self.bn1(self.expand(x))) if self.expand is not None else x
        y = self.bn2(self.dw(y))
        if self.excite is not None:
            y = F.hardswish(y)
            y = y * torch.sigmoid(self.excite(y.mean((2, 3), keepdim=True)))
        else:
            y = relu6(y)
        y = self.bn3(self.project(y))
        return x + y if self.residual else y


class MobileNetV2(nn.Module):
    """A small MobileNetV2 (random init): stem, inverted residuals with and without expansion, stride 2
    and residual blocks, a last 1x1 conv, dropout and a Linear; pointwise ops of every kind: clamp,
    hardswish, sigmoid, products with a gate, scalar mul/add and a per-channel gain parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, 2, 1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.blocks = nn.Sequential(MobileV2Block(8, 8, 1, 1), MobileV2Block(8, 12, 2, 4),
                                    MobileV2Block(12, 12, 1, 4, excite=True), MobileV2Block(12, 16, 1, 4),
                                    MobileV2Block(16, 16, 1, 4))
        self.last = nn.Conv2d(16, 32, 1, bias=False)
        self.last_bn = nn.BatchNorm2d(32)
        self.gain = nn.Parameter(torch.rand(32, 1, 1) + 0.5)
        self.dropout = nn.Dropout(0.2)
        self.fc = nn.Linear(32, 5)

    def forward(self, x):
        x = self.blocks(relu6(self.bn(self.stem(x))))
        x = relu6(self.last_bn(self.last(x))) * self.gain * 0.5 + 0.1
        return self.fc(self.dropout(x.mean((2, 3))))


def randomize_batch_norms(model: nn.Module, seed: int = 0) -> nn.Module:
    """Non-trivial BatchNorm statistics, as in a trained model."""
    gen = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.copy_(torch.randn(m.num_features, generator=gen) * 0.1)
            m.running_var.copy_(torch.rand(m.num_features, generator=gen) + 0.5)
            m.weight.data.copy_(torch.rand(m.num_features, generator=gen) + 0.5)
            m.bias.data.copy_(torch.randn(m.num_features, generator=gen) * 0.1)
    return model


MODELS = {"bottleneck": BottleneckNet, "mobilenet": MobileNetish, "folded_pad": FoldedPadNet,
          "option_a": OptionANet, "mobilenet_v2": MobileNetV2, "named_padding": NamedPaddingNet,
          "flattened_head": FlattenedHeadNet, "convnext": ConvNextish}
# the channel groups each model must expose, in order: in-block units by their consumer, coupled groups
# (residual streams) by their first producer
EXPECTED_UNITS = {
    "bottleneck": ["coupled:stem", "block1.conv2", "block1.conv3", "block2.conv2", "block2.conv3"],
    "mobilenet": ["coupled:stem", "ir1.project", "ir2.project", "pw2", "fc"],
    "folded_pad": ["conv2", "conv3", "fc"],
    "option_a": ["coupled:conv1", "layer1.0.conv2", "layer1.1.conv2", "layer2.0.conv2", "coupled:layer2.0.conv2",
                 "layer2.1.conv2"],
    "named_padding": ["conv2", "conv3", "fc"],
    "flattened_head": ["conv2", "fc"],
    "convnext": ["blocks.0.pwconv2", "blocks.1.pwconv2"],
    "mobilenet_v2": ["coupled:stem", "blocks.1.project", "coupled:blocks.1.project", "coupled:blocks.2.expand",
                     "blocks.2.excite.2", "blocks.3.project", "coupled:blocks.3.project", "blocks.4.project", "fc"],
}


def exported(name: str, size: int = 16):
    torch.manual_seed(0)
    model = randomize_batch_norms(MODELS[name]()).eval()
    return export_module(model, torch.randn(2, 3, size, size))


def prefix_module(gm: fx.GraphModule, target: fx.Node) -> fx.GraphModule:
    """A GraphModule computing `target`'s value from the model input (shares gm's parameters)."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        if node.op == "output":
            break
        if node.op == "call_module":  # shape guards of exported programs: not needed here
            continue
        env[node] = graph.node_copy(node, lambda n: env[n])
        if node is target:
            break
    graph.output(env[target])
    graph.eliminate_dead_code()
    return fx.GraphModule(gm, graph)


def write_conv_job(root: Path, size: int = 16) -> Path:
    """`model.pt2` (the bottleneck network on size x size images) and `cal.npz` (160 seeded uint8 NHWC
    images) in `root`: the smallest complete compression job. The service tests that need an `ok` use
    size 32: at 16 the network runs in ~1.3 ms and its pruned export measures only ~1.2x, close enough
    to the slower-than-dense line (0.98x) for a busy machine to cross it; at 32 it is ~1.47x."""
    save_program(exported("bottleneck", size), root / "model.pt2", torch.randn(2, 3, size, size))
    x = np.random.default_rng(0).integers(0, 256, size=(160, size, size, 3), dtype=np.uint8)
    np.savez(root / "cal.npz", x=x)
    return root


class TfliteInvertedResidual(nn.Module):
    """A MobileNetV2 inverted residual as converted from TFLite: BatchNorm folded into conv biases, ReLU6
    written as clamp(0, 6)."""

    def __init__(self, inp: int, out: int, stride: int, expand: int) -> None:
        super().__init__()
        hidden = inp * expand
        self.expand = nn.Conv2d(inp, hidden, 1) if expand != 1 else None
        self.dw = nn.Conv2d(hidden, hidden, 3, stride, 1, groups=hidden)
        self.project = nn.Conv2d(hidden, out, 1)
        self.residual = stride == 1 and inp == out

    def forward(self, x):
        y = relu6(self.expand(x)) if self.expand is not None else x
        y = self.project(relu6(self.dw(y)))
        return x + y if self.residual else y


class TfliteMobileNetV2(nn.Module):
    """ImageNet MobileNetV2 (Sandler et al. 2018, table 2) as a TFLite conversion gives it: no BatchNorm,
    clamp for ReLU6, 1,001 classes (background first). `width` scales every inner width (the last conv's
    1,280 channels stay, as in the paper for width <= 1), `depth` repeats of each stage at most."""

    SETTINGS = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2),
                (6, 320, 1, 1))  # (expansion, channels, repeats, first stride)

    def __init__(self, width: float = 1.0, depth: int = 4, classes: int = 1001, last: int = 1280) -> None:
        super().__init__()

        def scaled(c: int) -> int:
            return max(8, int(c * width + 4) // 8 * 8)

        inp = scaled(32)
        self.stem = nn.Conv2d(3, inp, 3, 2, 1)
        blocks = []
        for expand, channels, repeats, stride in self.SETTINGS:
            for i in range(min(repeats, depth)):
                blocks.append(TfliteInvertedResidual(inp, scaled(channels), stride if i == 0 else 1, expand))
                inp = scaled(channels)
        self.blocks = nn.Sequential(*blocks)
        self.last = nn.Conv2d(inp, last, 1)
        self.classifier = nn.Linear(last, classes)

    def forward(self, x):
        x = relu6(self.last(self.blocks(relu6(self.stem(x)))))
        return self.classifier(x.mean((2, 3)))


def scale_to_unit_variance(model: nn.Module, x: torch.Tensor) -> nn.Module:
    """Rescale each conv's and Linear's weights (in forward order) so that its output has unit variance on
    `x`: a deep random network without BatchNorm then neither vanishes nor saturates its clamps, as a
    trained one does not (layer-sequential unit-variance initialisation, Mishkin & Matas 2016)."""
    layers = [m for m in model.modules() if isinstance(m, nn.Conv2d | nn.Linear)]
    with torch.no_grad():
        for layer in layers:
            seen: list[torch.Tensor] = []
            hook = layer.register_forward_hook(lambda _m, _i, out, seen=seen: seen.append(out))
            model(x)
            hook.remove()
            std = float(seen[0].std())
            layer.weight.div_(max(std, 1e-6))
            if layer.bias is not None:
                layer.bias.div_(max(std, 1e-6))
    return model


def spread_predictions(model: nn.Module, classifier: nn.Linear, x: torch.Tensor, scale: float = 3.0) -> nn.Module:
    """Re-scale and re-centre `classifier` so that its logits on `x` have mean 0 and std `scale` per class.

    A random network's pooled features are dominated by their mean (ReLU outputs, averaged over space), so
    it predicts one or two classes for every input; a trained classifier's predictions spread over its
    classes, which is what top-1 agreement with it measures."""
    seen: list[torch.Tensor] = []
    hook = classifier.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    with torch.no_grad():
        model(x)
        hook.remove()
        features = seen[0].reshape(len(x), -1)
        logits = features @ classifier.weight.T  # (samples, classes)
        gain = scale / logits.std(0).clamp_min(1e-6)
        classifier.weight.mul_(gain[:, None])
        classifier.bias.copy_(-(logits * gain).mean(0))
    return model


def write_classifier_job(root: Path, size: int = 16, images: int = 160) -> Path:
    """`classifier.pt2` (the bottleneck network, its predictions spread over its 5 classes) and `images.npz`
    (`images` seeded uint8 NHWC images) in `root`."""
    x = np.random.default_rng(0).integers(0, 256, size=(images, size, size, 3), dtype=np.uint8)
    np.savez(root / "images.npz", x=x)
    torch.manual_seed(0)
    model = randomize_batch_norms(BottleneckNet()).eval()
    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    normalised = (torch.from_numpy(x).permute(0, 3, 1, 2).float() / 255 - mean) / std
    spread_predictions(model, model.fc, normalised)
    save_program(export_module(model, normalised[:2]), root / "classifier.pt2", normalised[:2])
    return root
