"""The timm model zoo that fxfuse is checked on: which models, which family, which input.

Shared by tests/test_timm_zoo.py (exactness, coverage) and benchmarks/zoo_coverage.py
(the coverage table in docs/results.md), so that the table describes exactly the models the tests
check. The smallest variant of each family, at a small resolution and batch 2: the
feature maps' BatchNorms see at least 2x2 spatial, i.e. 8 values per channel. Models that
batch-normalise 1x1 features (pooled, or a head that reaches 1x1) run at batch 4 (marked
POOLED_BN below): at batch 2 such a BatchNorm sees two values per channel, and the float64
rounding differences between eager and fxfuse grew to 21-1191x the 1e-9 tolerance by the
second step (0-0.3x at batch 4).

`FAST` is the representative part that `make test` runs; the rest carries the `zoo`
marker and runs with `make zoo`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # models are built with pretrained=False; never reach the hub

import torch  # noqa: E402
from torch import nn  # noqa: E402


@dataclass(frozen=True)
class ZooModel:
    name: str  # timm model name
    family: str  # one row of the coverage table
    size: int = 64  # square input resolution
    batch: int = 2
    kwargs: dict[str, Any] = field(default_factory=dict)  # extra timm.create_model arguments
    conv_bn: bool = True  # False for families without Conv2d→BatchNorm2d (ViT, ConvNeXt)

    def build(self) -> nn.Module:
        import timm

        return timm.create_model(self.name, pretrained=False, num_classes=10, **self.kwargs)

    def example_input(self, batch: int | None = None, size: int | None = None) -> torch.Tensor:
        generator = torch.Generator().manual_seed(0)
        return torch.randn(batch or self.batch, 3, size or self.size, size or self.size, generator=generator)


def _family(family: str, *names: str, **options: Any) -> list[ZooModel]:
    return [ZooModel(name, family, **options) for name in names]


ZOO: list[ZooModel] = [
    *_family("ResNet / ResNet-D / ResNeXt", "resnet18", "resnet26d", "resnet50", "resnext26ts", "seresnext26d_32x4d"),
    # tf_* variants pad with timm's Conv2dSame; efficientnet_cc_* uses CondConv2d.
    *_family("EfficientNet", "efficientnet_b0", "tf_efficientnet_b0", "efficientnet_lite0", "efficientnet_cc_b0_4e"),
    *_family("EfficientNetV2", "efficientnetv2_rw_t", "tf_efficientnetv2_b0"),
    *_family("MobileNetV2", "mobilenetv2_050"),
    *_family("MobileNetV3", "mobilenetv3_large_100", "mobilenetv3_small_050", "tf_mobilenetv3_small_minimal_100"),
    *_family("MixNet", "mixnet_s", "tf_mixnet_s"),  # MixedConv2d
    *_family("MnasNet", "mnasnet_small", "semnasnet_050"),
    *_family("RegNetX", "regnetx_002"),
    *_family("RegNetY", "regnety_002", "regnety_016"),
    *_family("RegNetZ", "regnetz_005"),
    *_family("CSPNet", "cspresnet50", "cspresnext50", "cs3darknet_s"),
    *_family("DarkNet", "darknet17"),
    *_family("DLA", "dla34", "dla46_c"),
    *_family("DPN", "dpn48b"),
    *_family("HRNet", "hrnet_w18_small"),
    *_family("GhostNet", "ghostnet_050"),
    *_family("ReXNet", "rexnet_100", batch=4),  # POOLED_BN: BatchNorm inside SqueezeExcite
    *_family("RepVGG", "repvgg_a0"),
    *_family("DenseNet", "densenet121"),
    *_family("VoVNet", "ese_vovnet19b_dw"),
    *_family("SelecSLS", "selecsls42b", batch=4),  # POOLED_BN: the head reaches 1x1 at 64x64
    *_family("Res2Net", "res2net50_14w_8s"),
    *_family("SKNet", "skresnet18", batch=4),  # POOLED_BN: BatchNorm in the selective-kernel attention
    *_family("ResNeSt", "resnest14d"),
    *_family("GENet", "gernet_s"),
    *_family("LCNet", "lcnet_050"),
    *_family("TinyNet", "tinynet_e"),
    *_family("FBNet", "fbnetc_100", "fbnetv3_b"),
    *_family("MobileViT", "mobilevit_xxs", "mobilevitv2_050"),
    *_family("ConvNeXt", "convnext_atto", conv_bn=False),
    *_family("ViT", "vit_tiny_patch16_224", size=32, kwargs={"img_size": 32}, conv_bn=False),
    # LeViT's attention fills a cache in eval (kept eager), its biases fix the input at 224x224.
    *_family("LeViT", "levit_128s", size=224),
    # LayerScale after attention and MLP (act_linear_scale), LayerNorm → qkv / fc1 (layer_norm_linear).
    *_family("DeiT-III", "deit3_small_patch16_224", size=32, kwargs={"img_size": 32}, conv_bn=False),
]


def without_dropout(model: nn.Module) -> nn.Module:
    """Dropout off, for comparisons of runs that would each draw their own masks: dropout
    modules, torchvision's StochasticDepth, timm's DropPath and the functional
    `F.dropout(x, self.drop_rate)` of timm heads (ghostnet, rexnet, mnasnet)."""
    for m in model.modules():
        if isinstance(m, nn.Dropout) or type(m).__name__ == "StochasticDepth":
            m.p = 0.0
        for attr in ("drop_rate", "drop_prob"):
            if isinstance(getattr(m, attr, None), float):
                setattr(m, attr, 0.0)
    return model


BY_NAME: dict[str, ZooModel] = {m.name: m for m in ZOO}

# What `make test` runs: BatchNormAct2d with SqueezeExcite and inplace SiLU (efficientnet_b0),
# Conv2dSame (tf_mobilenetv3_small_minimal_100), MixedConv2d (mixnet_s), ConvNormAct (regnetx_002),
# CSP stages (cs3darknet_s), plain nn.BatchNorm2d with ResNet-D stems (resnet26d), RepVGG blocks.
FAST: frozenset[str] = frozenset(
    {
        "efficientnet_b0",
        "tf_mobilenetv3_small_minimal_100",
        "mixnet_s",
        "regnetx_002",
        "cs3darknet_s",
        "resnet26d",
        "repvgg_a0",
    }
)

assert FAST <= set(BY_NAME), FAST - set(BY_NAME)
